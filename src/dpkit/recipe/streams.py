"""`dpkit train --data package.module:streams` with a per-process stream factory: `streams(seed, rank, world_size)`
returns (train, test), two iterables of this process's (x, y) batches (a DataLoader over an IterableDataset, a
shard of files per process), which the Engine takes as per-process streams (engine/process_streams.py): each step's
global batch is the union of what the processes yield, rows weighted; uneven ends finish exactly; the evaluation
counts every test sample once. A factory is told from a loader by its signature: three parameters (or more).
The train stream is iterated again for each pass over it (a DataLoader is), and its position is its own to resume.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpkit.launch.environment import process_place

STREAM_PARAMETERS = 3  # seed, rank, world_size


@dataclass(frozen=True)
class Streams:
    """The factory a run's processes call, each for its own (train, test) streams."""

    factory: Callable[..., Any]
    name: str

    def for_this_process(self, seed: int) -> tuple[Iterable, Iterable]:
        place = process_place()
        try:
            made = self.factory(seed, place.rank, place.world_size)
        except Exception as error:
            raise ValueError(
                f"data: {self.name}(seed, rank, world_size) raised {type(error).__name__}: {error}"
            ) from error
        if not isinstance(made, (tuple, list)) or len(made) != 2 or not all(_iterable(part) for part in made):
            raise TypeError(
                f"data: {self.name}(seed, rank, world_size) returned {type(made).__name__}; expected (train, test), "
                "two iterables of this process's (x, y) batches"
            )
        return made[0], made[1]

    def first_batch(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first (x, y) batch of this process's train stream: what the checks try the model on."""
        train, _ = self.for_this_process(seed)
        batch = next(iter(train), None)
        if (
            not isinstance(batch, (tuple, list))
            or len(batch) < 2
            or not all(isinstance(t, torch.Tensor) for t in batch[:2])
        ):
            raise TypeError(
                f"data: the train stream of {self.name} yielded {type(batch).__name__}; expected (x, y) batches"
            )
        return batch[0], batch[1]


def is_stream_factory(loader: Callable[..., Any]) -> bool:
    """Whether `loader` is a per-process stream factory (seed, rank, world_size), not a loader(seed)."""
    try:
        parameters = inspect.signature(loader).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= STREAM_PARAMETERS


def evaluate_stream(engine: Any, model: nn.Module, test: Iterable) -> tuple[float, float, int]:
    """(mean loss, accuracy, samples) over every process's test stream, each sample counted once: this process's
    sums and count, reduced once (a rank that ran out sits out with zero rows)."""
    import torch.nn.functional as F

    totals = torch.zeros(3, dtype=torch.float64)
    model.eval()
    try:
        with torch.no_grad():
            for inputs, targets in engine.setup_dataloader(test):
                output = model(inputs).float()
                totals[0] += F.cross_entropy(output, targets, reduction="sum").double().cpu()
                totals[1] += (output.argmax(dim=1) == targets).sum().double().cpu()
                totals[2] += len(targets)
    finally:
        model.train()
    loss_sum, correct, samples = engine.reduce(totals, "sum").tolist()
    return loss_sum / max(samples, 1), correct / max(samples, 1), int(samples)


def _iterable(value: object) -> bool:
    return isinstance(value, Iterable) and not isinstance(value, (torch.Tensor, str, bytes))
