"""The data position: a loader's global batches, with a position (epoch, next batch) that a state saves.

The order of an epoch is drawn when its iterator starts (a shuffling sampler draws a permutation from its
generator or torch's), so the loader also keeps the generator states from the start of the epoch; a
resumed epoch redraws the same order from them and skips the used batches by index, without loading
their data.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from dpkit.checkpoint.errors import CheckpointCorruptError
from dpkit.checkpoint.generators import capture_rng, restore_rng

if TYPE_CHECKING:
    from dpkit.strategies import Strategy


@dataclass(frozen=True)
class BatchRecord:
    """What the Engine needs to know about the batch a loader just yielded."""

    epoch: int
    index: int  # the global batch's position in its epoch
    rows: int  # rows this process received
    global_rows: int  # rows of the global batch
    loss_weight: float  # turns this process's mean loss into its part of an average over processes
    # a per-process stream's batch (engine/process_streams.py): its mean loss counts as a sum over its `rows`
    # (loss_weight = rows; 0 for a shadow), and the step divides by the window's rows over every process
    from_stream: bool = False


class GlobalBatches(Sampler[list[int]]):
    """The batches of indices of one epoch, from batch `start` on; this process's share of each (`share`).

    Iteration starts eagerly: `iter()` draws the epoch's order at once (so a resumed epoch can redraw it
    inside a window where the generators are set back) and skips `start` batches by index only.
    """

    def __init__(self, batch_sampler: Any, share: Callable[[list[int]], list[int]] = list):
        self.batch_sampler, self.share = batch_sampler, share
        self.start = 0
        self.records: collections.deque[tuple[int, int, int]] = collections.deque()  # (index, rows, global rows)

    def __iter__(self) -> Iterator[list[int]]:
        batches = iter(self.batch_sampler)
        skip, self.start = self.start, 0
        for _ in range(skip):
            if next(batches, None) is None:
                break
        first = next(batches, None)
        return self._shares(first, batches, skip)

    def _shares(self, first: Sequence[int] | None, batches: Iterator[Sequence[int]], index: int) -> Iterator[list[int]]:
        if first is None:
            return
        for batch in itertools.chain([first], batches):
            batch = list(batch)
            share = self.share(batch)
            self.records.append((index, len(share), len(batch)))
            index += 1
            yield share

    def __len__(self) -> int:
        return len(self.batch_sampler)


def _generators(loader: DataLoader, batch_sampler: object) -> list[torch.Generator]:
    """The torch generators that decide a loader's order (its own, its sampler's), each once."""
    found: dict[int, torch.Generator] = {}
    sampler = getattr(batch_sampler, "sampler", None)
    for owner in (loader, loader.sampler, batch_sampler, sampler):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and generator.device.type == "cpu":
            found.setdefault(id(generator), generator)
    return list(found.values())


def _stateful_samplers(batch_sampler: object) -> list[Any]:
    samplers = [batch_sampler, getattr(batch_sampler, "sampler", None)]
    return [
        s
        for s in samplers
        if s is not None and callable(getattr(s, "state_dict", None)) and callable(getattr(s, "load_state_dict", None))
    ]


def resumable(loader: object) -> TypeGuard[DataLoader]:
    """Whether the Engine can track and restore this loader's position (a map-style DataLoader with batches)."""
    return (
        isinstance(loader, DataLoader)
        and not isinstance(loader.dataset, IterableDataset)
        and loader.batch_sampler is not None
    )


class ResumableLoader:
    """A DataLoader's global batches (this process's share of each), with a position that can be saved.

    `rule` is the strategy's data rule (its hooks global_batches, batch_share and loss_weight); without one,
    this process sees every batch whole. `position()` gives the epoch and its next batch (the same in every
    process) and `order_state()` this process's generator states from the epoch's start; after
    `resume_from(position, order_state)`, the next iteration continues that epoch from that batch, in the
    same order. Every other iteration starts a new epoch, as a DataLoader does; samplers with `set_epoch`
    are told the epoch. `last_batch` is the record of the batch yielded last, also handed to `on_batch`.
    """

    def __init__(
        self, loader: DataLoader, rule: Strategy | None = None, *, on_batch: Callable[[BatchRecord], None] | None = None
    ):
        if not resumable(loader):
            raise TypeError(
                "loader: expected a torch DataLoader over a map-style dataset with batch_size= or batch_sampler=, "
                f"got {type(loader).__name__}"
            )
        self.source = loader
        self.rule = rule
        self.on_batch = on_batch
        if rule is None:
            self.global_batches = GlobalBatches(loader.batch_sampler)
        else:
            self.global_batches = GlobalBatches(rule.global_batches(loader), rule.batch_share)
        self.generators = _generators(loader, self.global_batches.batch_sampler)
        extra: dict[str, Any] = (
            {"prefetch_factor": loader.prefetch_factor, "persistent_workers": loader.persistent_workers}
            if loader.num_workers > 0
            else {}
        )
        self.loader = DataLoader(
            loader.dataset,
            batch_sampler=self.global_batches,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator,
            **extra,
        )
        self.epoch = 0  # the epoch the next iteration starts (or, mid-epoch, the one in progress)
        self.next_batch = 0  # the next batch of that epoch
        self.in_epoch = False
        self.epoch_start: dict[str, Any] | None = None  # generator states when the current epoch began
        self._resume: tuple[int, dict[str, Any]] | None = None  # (batch, generator states) for the next iteration
        self.last_batch: BatchRecord | None = None

    # --- what decides an epoch's order ----------------------------------------------------------------
    def _order_state(self) -> dict[str, Any]:
        return {
            "rng": capture_rng(cuda=False),
            "generators": [g.get_state() for g in self.generators],
            "samplers": [s.state_dict() for s in _stateful_samplers(self.global_batches.batch_sampler)],
        }

    def _set_order_state(self, state: dict[str, Any]) -> None:
        restore_rng(state["rng"])
        for generator, saved in zip(self.generators, state["generators"]):
            generator.set_state(saved)
        for sampler, saved in zip(_stateful_samplers(self.global_batches.batch_sampler), state["samplers"]):
            sampler.load_state_dict(saved)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration runs (as DistributedSampler.set_epoch)."""
        self.epoch, self.next_batch, self.in_epoch, self._resume = epoch, 0, False, None

    def _tell_samplers(self, epoch: int) -> None:
        for sampler in (self.global_batches.batch_sampler, getattr(self.global_batches.batch_sampler, "sampler", None)):
            if sampler is not None and callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self.in_epoch and self._resume is None:  # the previous iteration was left early: a new epoch
            self.epoch, self.in_epoch = self.epoch + 1, False
        epoch = self.epoch
        self._tell_samplers(epoch)
        self.global_batches.records.clear()
        resume, self._resume = self._resume, None
        if resume is not None and resume[0] > 0:
            start, order_state = resume
            now = capture_rng(cuda=False)
            self._set_order_state(order_state)  # redraw the epoch's order as it was first drawn
            self.global_batches.start = start
            iterator = iter(self.loader)
            restore_rng(now)  # the global generators continue from the saved state, not from the redraw
            self.epoch_start = order_state
        else:
            start = 0
            self.epoch_start = self._order_state()
            iterator = iter(self.loader)
        self.in_epoch, self.next_batch = True, start
        for batch in iterator:
            index, rows, global_rows = self.global_batches.records.popleft()
            self.next_batch = index + 1
            weight = 1.0 if self.rule is None else self.rule.loss_weight(rows, global_rows)
            self.last_batch = BatchRecord(epoch, index, rows, global_rows, weight)
            if self.on_batch is not None:
                self.on_batch(self.last_batch)
            yield batch
        self.epoch, self.next_batch, self.in_epoch = epoch + 1, 0, False

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # dataset, batch_size, …
        if name in ("source", "loader", "global_batches", "rule", "on_batch"):
            raise AttributeError(name)
        return getattr(self.source, name)

    # --- saving and restoring the position --------------------------------------------------------------
    def position(self) -> dict[str, int]:
        """Shared by every process: the epoch and its next global batch (same under any world size)."""
        return {
            "epoch": self.epoch,
            "next_batch": self.next_batch if self.in_epoch else 0,
            "batches_per_epoch": len(self.global_batches),
            "dataset_size": self._dataset_size(),
        }

    def _dataset_size(self) -> int:
        # a map-style dataset (resumable() checked) has a length; torch's Dataset type does not say so
        return len(self.source.dataset)  # type: ignore[arg-type]

    def order_state(self) -> dict[str, Any] | None:
        """This process's generator states from the start of the epoch in progress (None between epochs)."""
        return self.epoch_start if self.in_epoch else None

    def check_position(self, position: object, source: str) -> None:
        if not isinstance(position, dict) or not {"epoch", "next_batch", "batches_per_epoch"} <= set(position):
            raise CheckpointCorruptError(f"{source}: the data position is missing or incomplete")
        here = len(self.global_batches)
        size = self._dataset_size()
        if position["batches_per_epoch"] != here or position.get("dataset_size", size) != size:
            raise ValueError(
                f"loader: the state was saved with {position['batches_per_epoch']} batches per epoch over "
                f"{position.get('dataset_size')} samples, this loader has {here} over {size}; "
                "resume with the same dataset and global batch size"
            )

    def resume_from(self, position: dict[str, int], order_state: dict[str, Any] | None) -> None:
        """Continue at `position` on the next iteration (after check_position)."""
        self.epoch, self.next_batch = int(position["epoch"]), int(position["next_batch"])
        self.in_epoch = self.next_batch > 0
        if self.next_batch > 0 and order_state is None:
            raise CheckpointCorruptError(
                "the state stops mid-epoch but holds no generator states for that epoch's order"
            )
        self._resume = (self.next_batch, order_state) if self.next_batch > 0 and order_state is not None else None
