"""torch.nn.parallel's functional verbs with torch's signatures, on dpkit's strict pieces.

    from dpkit.parallel import data_parallel, replicate, scatter, gather, parallel_apply

Code written against `torch.nn.parallel` runs by changing the import; devices may be CUDA indices,
"cuda:1", virtual CPU devices "cpu:3" or torch.device. What dpkit adds stays on: split tensors must agree
on the batch size (a tensor meant for every replica is wrapped in `dpkit.Broadcast`), errors name the
argument path, the replica and its device, and gather warns about a batch flattened into another dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dpkit.checks import check_dim
from dpkit.devices import DeviceLike, parse_device, parse_device_list, tensor_on
from dpkit.parallel import apply
from dpkit.parallel.gather import gather
from dpkit.parallel.nested import map_leaves
from dpkit.parallel.replicate import replicate
from dpkit.parallel.scatter import (
    Broadcast,
    _is_broadcast,
    _move,
    common_batch_size,
    other_sizes,
    plan_split,
    scatter_for_device,
    unwrap_broadcasts,
)

__all__ = ["data_parallel", "gather", "parallel_apply", "replicate", "scatter", "scatter_kwargs"]

parallel_apply = apply.parallel_apply


def _devices(target_gpus: Sequence[DeviceLike] | None, argument: str) -> list[torch.device]:
    return parse_device_list(target_gpus, argument=argument)


def _unwrapped_on(device: torch.device) -> Callable[[str, Any], Any]:
    """A leaf as it goes to `device` unsplit: a Broadcast marker's tensor moved there, anything else as is."""

    def leaf_on(_path: str, leaf: Any) -> Any:
        return _move(leaf.tensor, device) if isinstance(leaf, Broadcast) else leaf

    return leaf_on


def _split(
    trees: Sequence[tuple[str, Any]], devices: list[torch.device], dim: int
) -> tuple[list[int] | None, list[list[Any]]]:
    """Rows per device that gets any (None when nothing is split) and, per device, each tree's part."""
    batch_size = common_batch_size(trees, dim)
    if batch_size is None:  # nothing to split: every device gets everything, Broadcast markers unwrapped
        parts = [[map_leaves(_unwrapped_on(d), tree, root, _is_broadcast) for root, tree in trees] for d in devices]
        return None, parts
    plan = plan_split(batch_size, len(devices))
    rows, parts = [], []
    for device, offset, size in zip(devices, plan.offsets, plan.sizes):
        if size > 0:  # fewer rows than devices: the surplus devices get nothing, as in torch
            per_tree, _ = scatter_for_device(
                tuple(tree for _, tree in trees), {}, offset=offset, size=size, device=device, dim=dim
            )
            rows.append(size)
            parts.append(list(per_tree))
    return rows, parts


def scatter(inputs: Any, target_gpus: Sequence[DeviceLike], dim: int = 0) -> list[Any]:
    """torch.nn.parallel.scatter: `inputs` split along `dim` into one part per device (same structure;
    non-tensors copied to every part). Fewer rows than devices gives fewer parts, as in torch."""
    devices = _devices(target_gpus, "target_gpus")
    _, parts = _split((("inputs", inputs),), devices, check_dim(dim))
    return [part[0] for part in parts]


def scatter_kwargs(
    inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, target_gpus: Sequence[DeviceLike], dim: int = 0
) -> tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]]:
    """torch.nn.parallel.scatter_gather.scatter_kwargs: per-device positional and keyword arguments, split
    together (their split tensors must agree on the batch size)."""
    devices = _devices(target_gpus, "target_gpus")
    check_dim(dim)
    inputs = tuple(inputs) if inputs is not None else ()
    kwargs = dict(kwargs) if kwargs else {}
    if not inputs and not kwargs:
        return (), ()
    _, parts = _split((("inputs", inputs), ("kwargs", kwargs)), devices, dim)
    return tuple(tuple(p[0]) for p in parts), tuple(p[1] for p in parts)


def data_parallel(
    module: nn.Module,
    inputs: Any,
    device_ids: Sequence[DeviceLike] | None = None,
    output_device: DeviceLike | None = None,
    dim: int = 0,
    module_kwargs: dict[str, Any] | None = None,
) -> Any:
    """torch.nn.parallel.data_parallel: one call of `module` split across `device_ids` (scatter,
    replicate, parallel_apply, gather). A non-tuple `inputs` is the module's one positional argument."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    check_dim(dim)
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    devices = parse_device_list(device_ids)
    source = devices[0]
    target = source if output_device is None else parse_device(output_device, argument="output_device")
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in named:
            if not tensor_on(tensor, source):
                raise RuntimeError(
                    f"{kind} '{name}' is on {tensor.device} but device_ids[0] is {source}; "
                    f"move the module there first (module.to('{source}'))"
                )
    kwargs = dict(module_kwargs) if module_kwargs else {}
    batch_size = common_batch_size((("inputs", inputs), ("module_kwargs", kwargs)), dim)
    if batch_size is None or len(devices) == 1:
        args, kw = unwrap_broadcasts(inputs, kwargs, source)
        if batch_size is not None:  # one device: the whole batch, moved there
            (args, kw) = _split((("inputs", args), ("module_kwargs", kw)), devices, dim)[1][0]
        return module(*args, **kw)
    rows, parts = _split((("inputs", inputs), ("module_kwargs", kwargs)), devices, dim)
    used = devices[: len(parts)]
    replicas = replicate(module, used, source)
    outputs = apply.parallel_apply(replicas, [tuple(p[0]) for p in parts], [p[1] for p in parts], used)
    return gather(outputs, target, dim, rows=rows, input_sizes=sorted(other_sizes((inputs, kwargs), dim)))
