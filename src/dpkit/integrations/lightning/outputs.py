"""What a step returns, read and combined: training_step's loss and what it leaves besides (loss_of), and the
replicas' outputs combined as one device's output for the whole batch (combine_outputs, training_output)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dpkit.parallel.nested import is_namedtuple

ONLY_LOSS = object()  # what a training_step that returned a bare loss tensor leaves besides its loss


def loss_of(method: str, output: object, device: torch.device) -> tuple[torch.Tensor, object]:
    """(the loss a replica hands back, what it leaves besides) for training_step's output."""
    if output is None:  # the step skips this batch: a stand-in loss, never backpropagated
        return torch.zeros((), device=device), None
    if isinstance(output, torch.Tensor):
        loss, rest = output, ONLY_LOSS
    elif isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        loss, rest = output["loss"], {key: value for key, value in output.items() if key != "loss"}
    else:
        raise TypeError(
            f"{method}: must return a loss tensor, a dict with a 'loss' tensor, or None; got {type(output).__name__}"
        )
    if loss.dim() != 0:
        raise ValueError(
            f"{method}: must return a 0-dim loss (a mean over the rows it was given), got shape {tuple(loss.shape)}"
        )
    return loss, rest


def combine_outputs(values: Sequence[Any], rows: Sequence[int], device: torch.device) -> Any:
    """One output from the replicas' outputs of a step, as one device's output for the whole batch:
    tensors with the replicas' rows along dim 0 are concatenated in row order; a floating 0-dim tensor (a
    mean, such as a loss) is the replicas' values weighted by their rows; an integer 0-dim tensor (a count)
    is their sum; dicts, lists and tuples are combined item by item; None stays None; other values equal in
    every replica are that value, else the list of the replicas' values (as is any other tensor)."""
    first = values[0]
    if all(value is None for value in values):
        return None
    if all(isinstance(value, torch.Tensor) for value in values):
        moved = [value if device.type == "cpu" else value.to(device) for value in values]
        if first.dim() == 0 and all(value.dim() == 0 for value in values):
            if first.is_floating_point():
                total = sum(rows)
                return sum(value * (n / total) for value, n in zip(moved, rows))
            return sum(moved[1:], moved[0])
        if all(value.dim() > 0 and value.shape[0] == n for value, n in zip(values, rows)):
            return torch.cat(moved)
        return list(values)
    if isinstance(first, Mapping) and all(isinstance(v, Mapping) and v.keys() == first.keys() for v in values):
        mapping_class: Any = type(first)  # the user's Mapping class, built from a dict
        return mapping_class({key: combine_outputs([v[key] for v in values], rows, device) for key in first})
    if isinstance(first, (list, tuple)) and all(type(v) is type(first) and len(v) == len(first) for v in values):
        parts = [combine_outputs([v[k] for v in values], rows, device) for k in range(len(first))]
        return type(first)(*parts) if is_namedtuple(first) else type(first)(parts)
    if all(_same(value, first) for value in values[1:]):
        return first
    return list(values)


def _same(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def training_output(method: str, loss: torch.Tensor, outputs: list, counts: list[int], device: torch.device) -> Any:
    """training_step's result over the replicas: the combined loss (with the rest of their outputs combined
    beside it, as a dict), or None where every replica skipped the batch."""
    skipped = [output is None for output in outputs]
    if all(skipped):
        return None
    if any(skipped):
        raise RuntimeError(
            f"{method}: returned None (skip the batch) in some replicas and a loss in others; a step that "
            "skips must skip for the whole batch (decide from something every replica sees, not from its rows)"
        )
    if outputs[0] is ONLY_LOSS:
        return loss
    return {"loss": loss, **combine_outputs(outputs, counts, device)}
