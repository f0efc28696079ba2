"""Per-process streams under a strategy with a process per device: each process iterates its own batches (a
DataLoader over an IterableDataset, a shard of files, any iterable), and a step's global batch is the union of
what the processes hold at that step, of any sizes.

Before each batch reaches the loop, the processes exchange how many rows each holds (one all-reduce of a few
numbers: every rank learns every rank's rows). That gives two things:

- The weights. A batch's mean loss is counted as a sum over its rows (times the strategy's sum weight), and the
  step divides the gradients by the window's rows over every process, known from the exchanges: each row of the
  step's union weighs the same, with accumulation too (engine.backward; engine/item_weighting.py).
- The ends. When every rank is out, every loop ends at the same batch. When some are out and others are not,
  `uneven="join"` (the default) keeps the ones that are out in the step: their loop sees a shadow batch that weighs
  nothing (zero rows, zero items: no gradient), so every collective of the step still has every rank, and the
  weights are those of one device trained on each step's present batches; rank 0 says at the end of the pass how
  the counts differed. In training the shadow is the rank's last batch again (a forward and backward of real
  rows, scaled by zero: an empty batch's mean loss would be NaN); with the model in eval mode it is that batch
  cut to zero rows, so an evaluation that adds up its own sums and counts counts every sample once.
  `uneven="stop"` stops every rank at once with one line naming the rank
  that ran out.

The exchange must come before the loop body: a rank that is out learns here whether to run a shadow step or end
its loop, before any collective of the step (torch's Join pays the same all-reduce per iteration).

A stream's position is not part of a saved state (engine.save_state says so once): resuming it is the iterable's
own business.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils._pytree import tree_map

from dpkit.engine.item_weighting import ItemCount
from dpkit.engine.resumable_loader import BatchRecord
from dpkit.parallel.scatter import common_batch_size

if TYPE_CHECKING:
    from dpkit.strategies import Strategy

log = logging.getLogger("dpkit")

UNEVEN = ("join", "stop")


def check_uneven(uneven: object) -> str:
    if uneven not in UNEVEN:
        raise ValueError(
            f"uneven: expected 'join' (a rank that runs out of batches keeps joining the others' steps with zero "
            f"weight until every rank is out) or 'stop' (every rank stops, naming the one that ran out), got {uneven!r}"
        )
    return str(uneven)


def rows_of(batch: Any) -> int:
    """The rows of a batch: the common size of its tensors' first dimension."""
    rows = common_batch_size((("batch", batch),), 0)
    if rows is None:
        raise TypeError(
            "loader: a per-process stream's batches must hold tensors with a batch dimension, got "
            f"{type(batch).__name__}"
        )
    return rows


def _no_rows(batch: Any) -> Any:
    """`batch` with every tensor cut to zero rows (its structure kept)."""
    return tree_map(lambda value: value[:0] if isinstance(value, torch.Tensor) and value.dim() > 0 else value, batch)


def stream_weight(
    record: BatchRecord, items: float | None, counts: ItemCount, strategy: Strategy
) -> tuple[float, float]:
    """(the loss's scale, the items it counts) for a stream's batch in engine.backward: a mean loss counts as a sum
    over the batch's rows, whose totals the rows exchange already gave (the step divides by the window's rows over
    every process, no reduction); a shadow (a rank sitting out) weighs nothing, with or without items=."""
    if record.rows == 0:
        counts.add(0.0, known_total=None if items is not None else float(record.global_rows))
        return 0.0, 0.0
    if items is None:
        counts.add(float(record.rows), known_total=float(record.global_rows))
        return strategy.sum_weight() * record.rows, float(record.rows)
    counts.add(items)
    return strategy.sum_weight(), items


class StreamEnded(RuntimeError):
    """uneven="stop": a rank ran out of batches while others had more."""


class ProcessStream:
    """This process's own batches, with every rank's rows exchanged before each (see the module doc).

    `on_batch` receives each batch's record (from_stream: rows this process holds, global_rows: the batch's union;
    a shadow has 0 rows)."""

    def __init__(
        self,
        source: Iterable,
        strategy: Strategy,
        uneven: str,
        on_batch: Callable[[BatchRecord], None] | None = None,
        training: Callable[[], bool] = lambda: True,
        on_end: Callable[[], None] | None = None,
    ):
        if isinstance(source, (torch.Tensor, str, bytes)) or not isinstance(source, Iterable):
            raise TypeError(f"loader: expected an iterable of this process's batches, got {type(source).__name__}")
        self.source = source
        self.strategy = strategy
        self.uneven = check_uneven(uneven)
        self.on_batch = on_batch
        self.training = training  # whether the model trains now (a shadow replays its last batch) or evaluates
        self.on_end = on_end  # told when a pass ends: what follows the loop is nobody's shadow
        self.epoch = 0
        self.last_batch: BatchRecord | None = None
        self.batches_seen: list[int] = []  # the last pass: how many batches each rank held
        self.joined_batches = 0  # the last pass: batches some rank sat out (shadows)

    def _exchange(self, rows: int) -> list[int]:
        """Every rank's rows of this batch (0: out), in one all-reduce."""
        mine = torch.zeros(self.strategy.world_size, dtype=torch.float64)
        mine[self.strategy.rank] = rows
        return [int(value) for value in self.strategy.all_reduce(mine, "sum").tolist()]

    def __iter__(self) -> Iterator[Any]:
        iterator, last, out = iter(self.source), None, False
        world = self.strategy.world_size
        self.batches_seen, self.joined_batches, index = [0] * world, 0, 0
        while True:
            batch = None if out else next(iterator, None)
            out = batch is None
            counts = self._exchange(0 if batch is None else rows_of(batch))
            present = [rank for rank, rows in enumerate(counts) if rows > 0]
            if not present:
                break
            self.batches_seen = [seen + (rows > 0) for seen, rows in zip(self.batches_seen, counts)]
            if len(present) < world:
                self._uneven(counts)
            if batch is None:
                if last is None:
                    raise ValueError(
                        f"loader: rank {self.strategy.rank}'s stream yielded no batch at all while the others did; "
                        "give every process at least one batch (its shadow steps replay its last one)"
                    )
                batch = last if self.training() else _no_rows(last)
            rows = counts[self.strategy.rank]
            # the mean loss of the batch becomes a sum over its rows (engine.backward): a weight of `rows`
            self.last_batch = BatchRecord(self.epoch, index, rows, sum(counts), float(rows), from_stream=True)
            if self.on_batch is not None:
                self.on_batch(self.last_batch)
            last, index = batch, index + 1
            yield batch
        if self.on_end is not None:
            self.on_end()
        self._say_the_ends(index)
        self.epoch += 1

    def _uneven(self, counts: list[int]) -> None:
        out = [rank for rank, rows in enumerate(counts) if rows == 0]
        if self.uneven == "stop":
            raise StreamEnded(
                f"loader: rank{'s' if len(out) > 1 else ''} {', '.join(map(str, out))} ran out of batches after "
                f"{min(self.batches_seen[rank] for rank in out)} while the others had more (uneven='stop'); "
                "uneven='join' lets them sit out the remaining batches with zero weight"
            )
        self.joined_batches += 1

    def _say_the_ends(self, batches: int) -> None:
        """Rank 0, at the end of a pass where the counts differed: which rank ran out when, and what ran without it."""
        if not self.joined_batches or self.strategy.rank != 0:
            return
        ends = "; ".join(
            f"rank {rank} ran out after {seen} batch{'es' if seen != 1 else ''}"
            for rank, seen in enumerate(self.batches_seen)
            if seen < batches
        )
        log.warning(
            "uneven ends (epoch %d): %s; %d of %d batches ran without every rank (it sat out with zero weight)",
            self.epoch,
            ends,
            self.joined_batches,
            batches,
        )

    def __len__(self) -> int:
        return len(cast(Sized, self.source))  # (a sized source only)

    def __getattr__(self, name: str) -> Any:  # dataset, batch_size, …
        if name in ("source", "strategy"):
            raise AttributeError(name)
        return getattr(self.source, name)
