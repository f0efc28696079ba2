"""Split nested inputs and kwargs into per-device chunks along the batch dimension.

Rules (where torch's DataParallel is lenient, dpkit is strict):
- every tensor that is split must have the same size along `dim`, or a ValueError names the paths;
- a tensor that should reach every replica whole is marked with `Broadcast(t)`;
- a 0-dim tensor (or one without `dim`) that is not marked is an error that suggests Broadcast;
- non-tensor leaves reach every replica unchanged;
- sizes differ by at most one row, and a batch smaller than the device count uses one row per device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

from dpkit.checks import check_int, check_int_list
from dpkit.parallel.nested import leaves, map_leaves


class Broadcast:
    """Marks a tensor that every replica receives whole (on its own device) instead of a slice."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"Broadcast: expected a tensor, got {type(tensor).__name__}; "
                "non-tensor values already reach every replica unchanged"
            )
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"Broadcast(shape={tuple(self.tensor.shape)}, device={self.tensor.device})"


def _is_broadcast(obj: object) -> bool:
    return isinstance(obj, Broadcast)


@dataclass(frozen=True)
class SplitPlan:
    """How one call is split: rows per device (aligned with the device list; 0 = no replica there)."""

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
    check_int(n_devices, "n_devices", meaning="number of devices")
    base, extra = divmod(batch_size, n_devices)
    return [base + (1 if i < extra else 0) for i in range(n_devices)]


def batch_size_of(inputs: Sequence[Any], kwargs: dict[str, Any], dim: int) -> int | None:
    """The common size along `dim` of every tensor to split, or None when there is nothing to split."""
    return common_batch_size((("args", tuple(inputs)), ("kwargs", kwargs)), dim)


def common_batch_size(trees: Sequence[tuple[str, Any]], dim: int) -> int | None:
    """batch_size_of for any (root name, nested structure) pairs; the root names start the error paths."""
    found: list[tuple[str, int]] = []
    for root, tree in trees:
        for path, leaf in leaves(tree, root, _is_broadcast):
            if not isinstance(leaf, torch.Tensor):
                continue
            if not -leaf.dim() <= dim < leaf.dim():  # a negative dim counts from each tensor's end, as in torch
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


def other_sizes(trees: Sequence[Any], dim: int) -> set[int]:
    """The sizes of every split tensor's dimensions other than `dim` (sequence lengths, features, ...)."""
    sizes: set[int] = set()
    for _, leaf in leaves(tuple(trees), "", _is_broadcast):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            batch_dim = dim % leaf.dim()
            sizes.update(size for k, size in enumerate(leaf.shape) if k != batch_dim)
    return sizes


@overload
def check_chunk_sizes(chunk_sizes: None, n_devices: int) -> None: ...
@overload
def check_chunk_sizes(chunk_sizes: Sequence[int], n_devices: int) -> list[int]: ...
def check_chunk_sizes(chunk_sizes: Sequence[int] | None, n_devices: int) -> list[int] | None:
    """chunk_sizes as given by a user: None, or one non-negative row count per device, not all 0."""
    if chunk_sizes is None:
        return None
    sizes = check_int_list(chunk_sizes, "chunk_sizes", length=n_devices, meaning="one row count per device")
    if sum(sizes) == 0:
        raise ValueError("chunk_sizes: all entries are 0; at least one device must receive rows")
    return sizes


def plan_split(batch_size: int, n_devices: int, chunk_sizes: Sequence[int] | None = None) -> SplitPlan:
    if chunk_sizes is None:
        return SplitPlan(tuple(split_sizes(batch_size, n_devices)))
    sizes = tuple(check_chunk_sizes(chunk_sizes, n_devices))
    if sum(sizes) != batch_size:
        raise ValueError(
            f"chunk_sizes: {list(sizes)} sum to {sum(sizes)} but the batch has {batch_size} rows; "
            "the sizes must add up to the batch size (or pass chunk_sizes=None for a balanced split)"
        )
    return SplitPlan(sizes)


def _move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return tensor if tensor.device.type == "cpu" else tensor.to("cpu")
    return tensor.to(device, non_blocking=True)


def scatter_for_device(
    inputs: Sequence[Any], kwargs: dict[str, Any], *, offset: int, size: int, device: torch.device, dim: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments one replica receives: its slice of every split tensor, the rest unchanged."""

    def take(_path: str, leaf: Any) -> Any:
        if isinstance(leaf, Broadcast):
            return _move(leaf.tensor, device)
        if isinstance(leaf, torch.Tensor):
            return _move(leaf.narrow(dim, offset, size), device)
        return leaf

    return tuple(map_leaves(take, tuple(inputs), "args", _is_broadcast)), map_leaves(
        take, kwargs, "kwargs", _is_broadcast
    )


def unwrap_broadcasts(
    inputs: Sequence[Any], kwargs: dict[str, Any], device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments for a run-once call: Broadcast markers become their tensors on `device`."""

    def take(_path: str, leaf: Any) -> Any:
        return _move(leaf.tensor, device) if isinstance(leaf, Broadcast) else leaf

    return tuple(map_leaves(take, tuple(inputs), "args", _is_broadcast)), map_leaves(
        take, kwargs, "kwargs", _is_broadcast
    )


def scatter(
    inputs: Sequence[Any], kwargs: dict[str, Any], plan: SplitPlan, devices: Sequence[torch.device], dim: int
) -> list[tuple[torch.device, tuple[Any, ...], dict[str, Any]]]:
    """(device, args, kwargs) for every device that receives rows, in device order."""
    chunks = []
    for device, offset, size in zip(devices, plan.offsets, plan.sizes):
        if size > 0:
            args_i, kwargs_i = scatter_for_device(inputs, kwargs, offset=offset, size=size, device=device, dim=dim)
            chunks.append((device, args_i, kwargs_i))
    return chunks
