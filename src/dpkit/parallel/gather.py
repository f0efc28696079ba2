"""Merge the replicas' outputs on the output device.

Tensors are concatenated along `dim` in replica order; tuples, lists, dicts (in order), namedtuples and
dataclasses are rebuilt; a non-tensor leaf becomes the list of per-replica values (a string is a leaf,
never split into characters); None from every replica stays None. 0-dim tensors become a vector with
one value per replica, with a warning. Anything that does not line up is a ValueError naming the path
and the replica. A negative `dim` counts from each tensor's end, as in torch.

Given the rows each replica received, gather also warns when a tensor output looks like the batch was
flattened into another dimension, so concatenating along `dim` interleaves replicas' rows wrongly (see
`_looks_flattened`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from dpkit.checks import check_dim
from dpkit.devices import DeviceLike, parse_device
from dpkit.parallel.nested import children, is_dataclass_instance, is_namedtuple, rebuild

STACK = "stack"  # gather's scalars=: 0-dim outputs become a vector, one value per replica (torch's)
ROW_MEAN = "row-mean"  # 0-dim floating outputs become their mean weighted by the replicas' rows


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu" and tensor.device.type == "cpu":
        return tensor
    return tensor.to(device, non_blocking=True)


def _kind(obj: object) -> str:
    if obj is None:
        return "None"
    if isinstance(obj, torch.Tensor):
        return "tensor"
    if is_namedtuple(obj) or is_dataclass_instance(obj):
        return type(obj).__qualname__
    if isinstance(obj, (tuple, list, dict)):
        return type(obj).__name__
    return "value"


def _common_multiple(sizes: Sequence[int], rows: Sequence[int]) -> int | None:
    """m when sizes[i] == rows[i] * m for every replica (one integer m >= 2), else None."""
    if rows[0] == 0 or sizes[0] % rows[0]:
        return None
    m = sizes[0] // rows[0]
    return m if m >= 2 and all(s == r * m for s, r in zip(sizes, rows)) else None


def _looks_flattened(
    values: list[torch.Tensor], dim: int, rows: Sequence[int], input_sizes: Sequence[int]
) -> int | None:
    """The dimension the batch seems to have been flattened into, or None.

    The heuristic, built to stay quiet on ordinary outputs: it fires only when
    - the outputs' sizes along `dim` are not the rows the replicas received (else `dim` is the batch), and
    - another dimension k holds rows_i * m for every replica with one integer m >= 2, and
    - that m is evidently a product with the batch: m is a size of the inputs' other dimensions (e.g. the
      sequence length of a (seq, batch) input flattened to (seq*batch, vocab)), or the replicas got uneven
      rows and k still follows them exactly (a fixed-size output cannot), and
    - `dim` itself is not such a flattened batch (a (batch*seq, vocab) output gathered on dim 0 is fine).
    """
    sizes_along = [v.size(dim) for v in values]
    if list(sizes_along) == list(rows):
        return None
    uneven = len(set(rows)) > 1
    known = set(input_sizes)

    def follows_batch(sizes: Sequence[int]) -> bool:
        m = _common_multiple(sizes, rows)
        return m is not None and (m in known or uneven)

    if follows_batch(sizes_along):
        return None
    for k in range(values[0].dim()):
        if k != dim and follows_batch([v.size(k) for v in values]):
            return k
    return None


def _gather_tensors(
    values: list[torch.Tensor],
    path: str,
    device: torch.device,
    dim: int,
    rows: Sequence[int] | None = None,
    input_sizes: Sequence[int] = (),
    scalars: str = STACK,
) -> torch.Tensor:
    first = values[0]
    if first.dim() == 0:
        for i, value in enumerate(values):
            if value.dim() != 0:
                raise ValueError(
                    f"{path}: replica {i} returned shape {tuple(value.shape)} where replica 0 returned a 0-dim tensor"
                )
        if scalars == ROW_MEAN and rows is not None and len(rows) == len(values) and first.is_floating_point():
            # a mean the model computed over its rows (a loss): the batch's is the row-weighted mean of the replicas'
            total = sum(rows)
            terms = [_to(v, device) * (r / total) for v, r in zip(values, rows)]
            return torch.stack(terms).sum()
        warnings.warn(
            f"{path}: replicas returned 0-dim tensors; gathering them as a vector with one value per replica "
            "(compute the loss inside the replicas with loss_fn=, or return per-sample values)",
            UserWarning,
            stacklevel=4,
        )
        return torch.stack([_to(v, device) for v in values])
    if not -first.dim() <= dim < first.dim():
        raise ValueError(
            f"{path}: replica 0 returned a {first.dim()}-dim tensor with no dimension {dim} to concatenate along"
        )
    dim = dim % first.dim()
    flattened = None
    if rows is not None and len(rows) == len(values) and all(v.dim() == first.dim() for v in values):
        flattened = _looks_flattened(values, dim, rows, input_sizes)
    hint = (
        ""
        if flattened is None
        else (
            f"; dim {flattened} {[v.size(flattened) for v in values]} follows the rows "
            f"the replicas received {list(rows or ())}: "
            f"the batch seems flattened into dim {flattened}, "
            f"so concatenating along dim {dim} mixes replicas; keep the "
            f"batch in its own dimension in the output (e.g. view(seq, batch, -1)) or gather along dim {flattened}"
        )
    )
    expected = list(first.shape)
    for i, value in enumerate(values[1:], start=1):
        shape = list(value.shape)
        if len(shape) != len(expected) or any(a != b for k, (a, b) in enumerate(zip(shape, expected)) if k != dim):
            raise ValueError(
                f"{path}: replica {i} returned shape {tuple(shape)}, which does not match replica 0's "
                f"{tuple(expected)} outside dim {dim}{hint}"
            )
    if flattened is not None:
        warnings.warn(
            f"{path}: gathering along dim {dim}, where the replicas' sizes are {[v.size(dim) for v in values]}{hint}",
            UserWarning,
            stacklevel=4,
        )
    return torch.cat([_to(v, device) for v in values], dim=dim)


def _gather(
    values: list[Any],
    path: str,
    device: torch.device,
    dim: int,
    rows: Sequence[int] | None = None,
    input_sizes: Sequence[int] = (),
    scalars: str = STACK,
) -> Any:
    first = values[0]
    kind = _kind(first)
    for i, value in enumerate(values[1:], start=1):
        other = _kind(value)
        same_structure = other == kind and type(value) is type(first)
        if not same_structure and not (kind in ("value", "None") and other in ("value", "None")):
            raise ValueError(
                f"{path}: replica {i} returned {other} ({type(value).__name__}) "
                f"where replica 0 returned {kind} ({type(first).__name__})"
            )
    if kind == "None" and all(v is None for v in values):
        return None
    if kind == "tensor":
        return _gather_tensors(values, path, device, dim, rows, input_sizes, scalars)
    parts = children(first)
    if parts is None or kind in ("value", "None"):
        return list(values)
    if isinstance(first, dict):
        keys = list(first.keys())
        for i, value in enumerate(values[1:], start=1):
            if set(value.keys()) != set(keys):
                raise ValueError(
                    f"{path}: replica {i} returned keys {sorted(map(repr, value.keys()))}, "
                    f"replica 0 returned {sorted(map(repr, keys))}"
                )
        merged = [
            _gather([v[key] for v in values], f"{path}[{key!r}]", device, dim, rows, input_sizes, scalars)
            for key in keys
        ]
        return rebuild(first, merged)
    per_replica = [children(v) or [] for v in values]  # (each of the same type as the first: a container)
    for i, parts_i in enumerate(per_replica[1:], start=1):
        if len(parts_i) != len(parts):
            raise ValueError(f"{path}: replica {i} returned {len(parts_i)} items, replica 0 returned {len(parts)}")
    merged = [
        _gather([p[k][1] for p in per_replica], path + suffix, device, dim, rows, input_sizes, scalars)
        for k, (suffix, _) in enumerate(parts)
    ]
    return rebuild(first, merged)


def gather(
    outputs: Sequence[Any],
    target_device: DeviceLike,
    dim: int = 0,
    *,
    rows: Sequence[int] | None = None,
    input_sizes: Sequence[int] = (),
    scalars: str = STACK,
) -> Any:
    """torch.nn.parallel.gather's verb: one output on `target_device` from the replicas' outputs, in
    replica order. `target_device`: a dpkit device spec; -1 or "cpu" mean the CPU, as in torch.

    rows: the rows each replica received (enables the flattened-batch warning); input_sizes: the sizes of
    the split inputs' other dimensions (sequence lengths, ...), which make that warning surer.
    scalars: what 0-dim tensors become: STACK ("stack", torch's behaviour: a vector with one value per replica,
    and a warning) or ROW_MEAN ("row-mean": a floating one, such as a loss the model computed over its rows,
    becomes the mean of the replicas' weighted by `rows`, which it needs).
    """
    if not outputs:
        raise ValueError("gather: no outputs to gather")
    check_dim(dim)
    if scalars not in (STACK, ROW_MEAN):
        raise ValueError(f"scalars: expected {STACK!r} or {ROW_MEAN!r}, got {scalars!r}")
    if scalars == ROW_MEAN and (rows is None or len(rows) != len(outputs)):
        raise ValueError(
            f"rows: scalars={ROW_MEAN!r} needs the rows of each of the {len(outputs)} replicas, got {rows!r}"
        )
    if isinstance(target_device, torch.device) and target_device.index is not None:
        device = target_device
    elif target_device == -1 or target_device == "cpu":
        device = torch.device("cpu", 0)
    else:
        device = parse_device(target_device, argument="target_device")
    return _gather(
        list(outputs), "output", device, dim, None if rows is None else list(rows), tuple(input_sizes), scalars
    )
