"""`self.log` inside replicas: recorded in each replica's thread, logged once on the calling thread.

A LightningModule's `self.log` writes into the Trainer's result collection (or Fabric's loggers). Called in
replicas it would be lost (a deep copy has no trainer) or written from several threads at once, each with
its replica's value and the whole batch's size, the last one winning. Instead each replica's calls of
`self.log` and `self.log_dict` are recorded, and after the step the module logs each name once on the
calling thread: the replicas' values combined as `reduce_fx` says ('mean': weighted by each replica's rows,
or by its `batch_size=` when given; 'sum', 'max', 'min': over the replicas, as Lightning's sync_dist does
across processes), with `batch_size` the sum of those weights. A mean over rows logged so equals one
device's value for the whole batch, and so do the epoch means Lightning computes from it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

# (name, value: a tensor or a number, the other arguments of the call as given)
Record = tuple[str, torch.Tensor | float, dict]

_MEANS = ("mean", "avg", torch.mean)
_SUMS = ("sum", torch.sum)
_MAXIMA = ("max", torch.max)
_MINIMA = ("min", torch.min)


def _is_metric(value: object) -> bool:
    """A torchmetrics Metric (without importing torchmetrics): a module that computes a value."""
    return isinstance(value, nn.Module) and callable(getattr(value, "compute", None))


@functools.cache
def _signatures(cls: Any) -> tuple[inspect.Signature, inspect.Signature]:
    """The signatures of a LightningModule class's log and log_dict (Any: lightning is optional here)."""
    return inspect.signature(cls.log), inspect.signature(cls.log_dict)


class LogRecorder:
    """Stands in for a replica's `log` and `log_dict` while its step runs."""

    def __init__(self, module: nn.Module):
        self.records: list[Record] = []
        # a class is hashable; mypy compares type[Module] with Hashable's instance method __hash__
        self._log, self._log_dict = _signatures(type(module))  # type: ignore[arg-type]

    def log(self, *args: Any, **kwargs: Any) -> None:
        arguments = self._log.bind(None, *args, **kwargs).arguments
        arguments.pop(next(iter(arguments)))  # self
        name, value = arguments.pop("name"), arguments.pop("value")
        self._record(name, value, arguments)

    def log_dict(self, *args: Any, **kwargs: Any) -> None:
        arguments = self._log_dict.bind(None, *args, **kwargs).arguments
        arguments.pop(next(iter(arguments)))
        dictionary = arguments.pop("dictionary")
        if _is_metric(dictionary):
            raise TypeError(
                "self.log_dict: a torchmetrics MetricCollection logged inside a step that runs in dpkit's replicas "
                "updates the replicas' copies of its state; log the computed values instead, or log the collection "
                "from a hook that runs on the calling thread (on_train_batch_end, on_validation_epoch_end)"
            )
        for name, value in dictionary.items():
            self._record(name, value, dict(arguments))

    def _record(self, name: str, value: torch.Tensor | float, arguments: dict) -> None:
        if _is_metric(value):
            raise TypeError(
                f"self.log({name!r}, ...): a torchmetrics Metric logged inside a step that runs in dpkit's replicas "
                "updates the replicas' copies of its state; log the computed value (metric(preds, target)) instead, "
                "or log the metric from a hook that runs on the calling thread (on_train_batch_end, "
                "on_validation_epoch_end)"
            )
        self.records.append((name, value, arguments))


@contextlib.contextmanager
def recorded_logs(module: nn.Module, enabled: bool) -> Iterator[list[Record]]:
    """Inside: the module's log and log_dict record into the list yielded (when enabled)."""
    if not enabled:
        yield []
        return
    recorder = LogRecorder(module)
    module.__dict__["log"] = recorder.log  # an instance attribute: this object only, not its class
    module.__dict__["log_dict"] = recorder.log_dict
    try:
        yield recorder.records
    finally:
        module.__dict__.pop("log", None)
        module.__dict__.pop("log_dict", None)


def _as_tensor(value: torch.Tensor | float, device: torch.device, keep_graph: bool) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        tensor = value if keep_graph else value.detach()
    else:
        tensor = torch.tensor(float(value))
    return tensor.to(device) if tensor.device != device and device.type != "cpu" else tensor


def combine_logged(
    name: str, values: Sequence[torch.Tensor], weights: Sequence[float], reduce_fx: object
) -> torch.Tensor:
    """One value from the replicas' values of one logged name (see the module doc)."""
    if any(reduce_fx is fx or (isinstance(fx, str) and reduce_fx == fx) for fx in _MEANS):
        total = float(sum(weights))
        # (typeshed's sum() is int | Tensor, its start 0 when empty: there is a value per replica)
        return sum(value * (weight / total) for value, weight in zip(values, weights))  # type: ignore[return-value]
    if any(reduce_fx is fx or (isinstance(fx, str) and reduce_fx == fx) for fx in _SUMS):
        return sum(values[1:], values[0])
    if any(reduce_fx is fx or (isinstance(fx, str) and reduce_fx == fx) for fx in _MAXIMA):
        return torch.stack(list(values)).amax(dim=0)
    if any(reduce_fx is fx or (isinstance(fx, str) and reduce_fx == fx) for fx in _MINIMA):
        return torch.stack(list(values)).amin(dim=0)
    raise ValueError(
        f"self.log({name!r}, reduce_fx={reduce_fx!r}): dpkit combines the replicas' values for reduce_fx 'mean', "
        "'sum', 'max' or 'min'; use one of them, or log from a hook that runs on the calling thread"
    )


def replay(module: Any, per_replica: Sequence[tuple[int, Sequence[Record]]], device: torch.device) -> None:
    """Log on `module` (on the calling thread) what the replicas recorded; per_replica: (rows, records) in
    replica order. The k-th call of a name in each replica is combined with the k-th call in the others."""
    calls: dict[tuple[str, int], list[tuple[torch.Tensor | float, float, dict]]] = {}
    for rows, records in per_replica:
        seen: dict[str, int] = {}
        for name, value, arguments in records:
            k = seen[name] = seen.get(name, -1) + 1
            weight = arguments.get("batch_size") or rows
            calls.setdefault((name, k), []).append((value, weight, arguments))
    for (name, _), entries in calls.items():
        arguments = dict(entries[0][2])
        keep_graph = bool(arguments.get("enable_graph", False))
        values = [_as_tensor(value, device, keep_graph) for value, _, _ in entries]
        weights = [weight for _, weight, _ in entries]
        arguments["batch_size"] = int(sum(weights))
        combined = combine_logged(name, values, weights, arguments.get("reduce_fx", "mean"))
        module.log(name, combined, **arguments)


def logs_values(value: object) -> bool:
    """Whether a module has Lightning's log methods (a LightningModule)."""
    return callable(getattr(type(value), "log", None)) and callable(getattr(type(value), "log_dict", None))
