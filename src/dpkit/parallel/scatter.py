"""Split nested inputs and kwargs into per-device chunks along the batch dimension.

Rules (where torch's DataParallel is lenient, dpkit is strict):
- every tensor that is split must have the same size along `dim`, or a ValueError names the paths;
- a tensor that should reach every replica whole is marked with `Broadcast(t)`;
- a 0-dim tensor (or one without `dim`) that is not marked is an error that suggests Broadcast;
- non-tensor leaves reach every replica unchanged;
- sizes differ by at most one row, and a batch smaller than the device count uses one row per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from dpkit.parallel.nested import leaves, map_leaves


class Broadcast:
    """Marks a tensor that every replica receives whole (on its own device) instead of a slice."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Broadcast: expected a tensor, got {type(tensor).__name__}; non-tensor values already reach every replica unchanged")
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"Broadcast(shape={tuple(self.tensor.shape)}, device={self.tensor.device})"


def _is_broadcast(obj: Any) -> bool:
    return isinstance(obj, Broadcast)


@dataclass(frozen=True)
class SplitPlan:
    """How one call is split: rows per device (aligned with the device list; 0 = no replica there)."""

    batch_size: int
    sizes: tuple[int, ...]

    @property
    def offsets(self) -> list[int]:
        out, total = [], 0
        for size in self.sizes:
            out.append(total)
            total += size
        return out


def split_sizes(batch_size: int, n_devices: int) -> list[int]:
    """Balanced rows per device: sizes differ by at most one; surplus devices get 0 rows.

    10 rows on 4 devices -> [3, 3, 2, 2]; 36 on 7 -> [6, 5, 5, 5, 5, 5, 5]; 2 on 4 -> [1, 1, 0, 0].
    """
    if n_devices < 1:
        raise ValueError(f"n_devices: expected at least 1, got {n_devices}")
    base, extra = divmod(batch_size, n_devices)
    return [base + (1 if i < extra else 0) for i in range(n_devices)]


def batch_size_of(inputs: Sequence[Any], kwargs: dict[str, Any], dim: int) -> int | None:
    """The common size along `dim` of every tensor to split, or None when there is nothing to split."""
    found: list[tuple[str, int]] = []
    for root, tree in (("args", tuple(inputs)), ("kwargs", kwargs)):
        for path, leaf in leaves(tree, root, _is_broadcast):
            if not isinstance(leaf, torch.Tensor):
                continue
            if leaf.dim() <= dim:
                raise ValueError(
                    f"{path}: a {leaf.dim()}-dim tensor has no batch dimension {dim} to split; "
                    f"wrap it in dpkit.Broadcast(...) to pass it whole to every replica"
                )
            found.append((path, leaf.size(dim)))
    if not found:
        return None
    sizes = {size for _, size in found}
    if len(sizes) > 1:
        listing = ", ".join(f"{path}={size}" for path, size in found)
        raise ValueError(
            f"inputs disagree on the batch size along dim {dim}: {listing}; every split tensor must have the "
            "same size there (wrap tensors meant for every replica in dpkit.Broadcast)"
        )
    batch_size = sizes.pop()
    if batch_size == 0:
        raise ValueError(f"empty batch: the inputs have 0 rows along dim {dim}; there is nothing to split")
    return batch_size


def plan_split(batch_size: int, n_devices: int, chunk_sizes: Sequence[int] | None = None) -> SplitPlan:
    if chunk_sizes is None:
        return SplitPlan(batch_size, tuple(split_sizes(batch_size, n_devices)))
    sizes = tuple(int(s) for s in chunk_sizes)
    if len(sizes) != n_devices:
        raise ValueError(f"chunk_sizes: has {len(sizes)} entries for {n_devices} devices; give one row count per device")
    if sum(sizes) != batch_size:
        raise ValueError(
            f"chunk_sizes: {list(sizes)} sum to {sum(sizes)} but the batch has {batch_size} rows; "
            "the sizes must add up to the batch size (or pass chunk_sizes=None for a balanced split)"
        )
    return SplitPlan(batch_size, sizes)


def _move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return tensor if tensor.device.type == "cpu" else tensor.to("cpu")
    return tensor.to(device, non_blocking=True)


def scatter_for_device(inputs: Sequence[Any], kwargs: dict[str, Any], *, offset: int, size: int,
                       device: torch.device, dim: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments one replica receives: its slice of every split tensor, the rest unchanged."""

    def take(_path: str, leaf: Any) -> Any:
        if isinstance(leaf, Broadcast):
            return _move(leaf.tensor, device)
        if isinstance(leaf, torch.Tensor):
            return _move(leaf.narrow(dim, offset, size), device)
        return leaf

    return tuple(map_leaves(take, tuple(inputs), "args", _is_broadcast)), map_leaves(take, kwargs, "kwargs", _is_broadcast)


def unwrap_broadcasts(inputs: Sequence[Any], kwargs: dict[str, Any], device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments for a run-once call: Broadcast markers become their tensors on `device`."""

    def take(_path: str, leaf: Any) -> Any:
        return _move(leaf.tensor, device) if isinstance(leaf, Broadcast) else leaf

    return tuple(map_leaves(take, tuple(inputs), "args", _is_broadcast)), map_leaves(take, kwargs, "kwargs", _is_broadcast)


def scatter(inputs: Sequence[Any], kwargs: dict[str, Any], plan: SplitPlan, devices: Sequence[torch.device],
            dim: int) -> list[tuple[torch.device, tuple[Any, ...], dict[str, Any]]]:
    """(device, args, kwargs) for every device that receives rows, in device order."""
    chunks = []
    for device, offset, size in zip(devices, plan.offsets, plan.sizes):
        if size > 0:
            args_i, kwargs_i = scatter_for_device(inputs, kwargs, offset=offset, size=size, device=device, dim=dim)
            chunks.append((device, args_i, kwargs_i))
    return chunks
