"""Merge the replicas' outputs on the output device.

Tensors are concatenated along `dim` in replica order; tuples, lists, dicts (in order), namedtuples and
dataclasses are rebuilt; a non-tensor leaf becomes the list of per-replica values (a string is a leaf,
never split into characters); None from every replica stays None. 0-dim tensors become a vector with
one value per replica, with a warning. Anything that does not line up is a ValueError naming the path
and the replica.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from dpkit.parallel.nested import children, is_dataclass_instance, is_namedtuple, rebuild


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu" and tensor.device.type == "cpu":
        return tensor
    return tensor.to(device, non_blocking=True)


def _kind(obj: Any) -> str:
    if obj is None:
        return "None"
    if isinstance(obj, torch.Tensor):
        return "tensor"
    if is_namedtuple(obj) or is_dataclass_instance(obj):
        return type(obj).__qualname__
    if isinstance(obj, (tuple, list, dict)):
        return type(obj).__name__
    return "value"


def _gather_tensors(values: list[torch.Tensor], path: str, device: torch.device, dim: int) -> torch.Tensor:
    first = values[0]
    if first.dim() == 0:
        for i, value in enumerate(values):
            if value.dim() != 0:
                raise ValueError(f"{path}: replica {i} returned shape {tuple(value.shape)} where replica 0 returned a 0-dim tensor")
        warnings.warn(
            f"{path}: replicas returned 0-dim tensors; gathering them as a vector with one value per replica "
            "(compute the loss inside the replicas with loss_fn=, or return per-sample values)",
            UserWarning, stacklevel=4,
        )
        return torch.stack([_to(v, device) for v in values])
    if first.dim() <= dim:
        raise ValueError(f"{path}: replica 0 returned a {first.dim()}-dim tensor with no dimension {dim} to concatenate along")
    expected = list(first.shape)
    for i, value in enumerate(values[1:], start=1):
        shape = list(value.shape)
        if len(shape) != len(expected) or any(a != b for k, (a, b) in enumerate(zip(shape, expected)) if k != dim):
            raise ValueError(
                f"{path}: replica {i} returned shape {tuple(shape)}, which does not match replica 0's "
                f"{tuple(expected)} outside dim {dim}"
            )
    return torch.cat([_to(v, device) for v in values], dim=dim)


def _gather(values: list[Any], path: str, device: torch.device, dim: int) -> Any:
    first = values[0]
    kind = _kind(first)
    for i, value in enumerate(values[1:], start=1):
        other = _kind(value)
        same_structure = other == kind and type(value) is type(first)
        if not same_structure and not (kind in ("value", "None") and other in ("value", "None")):
            raise ValueError(f"{path}: replica {i} returned {other} ({type(value).__name__}) where replica 0 returned {kind} ({type(first).__name__})")
    if kind == "None" and all(v is None for v in values):
        return None
    if kind == "tensor":
        return _gather_tensors(values, path, device, dim)
    parts = children(first)
    if parts is None or kind in ("value", "None"):
        return list(values)
    if isinstance(first, dict):
        keys = list(first.keys())
        for i, value in enumerate(values[1:], start=1):
            if set(value.keys()) != set(keys):
                raise ValueError(f"{path}: replica {i} returned keys {sorted(map(repr, value.keys()))}, replica 0 returned {sorted(map(repr, keys))}")
        merged = [_gather([v[key] for v in values], f"{path}[{key!r}]", device, dim) for key in keys]
        return rebuild(first, merged)
    per_replica = [children(v) for v in values]
    for i, parts_i in enumerate(per_replica[1:], start=1):
        if len(parts_i) != len(parts):
            raise ValueError(f"{path}: replica {i} returned {len(parts_i)} items, replica 0 returned {len(parts)}")
    merged = [
        _gather([p[k][1] for p in per_replica], path + suffix, device, dim)
        for k, (suffix, _) in enumerate(parts)
    ]
    return rebuild(first, merged)


def gather(outputs: Sequence[Any], output_device: torch.device, dim: int = 0) -> Any:
    """One output on `output_device` from the replicas' outputs, in replica order."""
    if not outputs:
        raise ValueError("gather: no outputs to gather")
    return _gather(list(outputs), "output", output_device, dim)
