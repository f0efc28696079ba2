"""The step check of a process group (observe/collectives.py): each step's first collective carries every rank's
place (batches, steps, collective sequence), so ranks at different steps stop at once with one line naming both.

Where the marks ride is the strategy's choice, given to the process group: ddp's in its first gradient bucket
(IN_FIRST_BUCKET: the bucket's all-reduce, through ddp's comm hook), fsdp's in a step's first all-gather
(IN_FIRST_ALL_GATHER: carriers installed in the collective record). The closing collective (engine.close) takes
the shape of the collective that starts a step, so a rank that ran out of batches is named as such.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Final, Literal, TypeVar

import torch
import torch.distributed as dist

from dpkit.launch.environment import restart_count
from dpkit.launch.heartbeat import publish_now, publish_soon
from dpkit.observe.collectives import (
    CLOSING,
    GRADIENTS,
    RECORD,
    Collective,
    CollectiveMismatch,
    mismatch_message,
    read_marks,
    step_marks,
)

log = logging.getLogger("dpkit")
R = TypeVar("R")  # what a torch collective returns (its work handle, or None)

IN_FIRST_BUCKET: Final = "first gradient bucket"
IN_FIRST_ALL_GATHER: Final = "first all-gather"
MarksRide = Literal["first gradient bucket", "first all-gather"]

# how long a rank that found a mismatch waits for the others' record entries (they found it at the same moment)
_ENTRY_WAIT_SECONDS = 5.0


class StepMarks:
    """The step-mark protocol of one process group: the marks' carriers, the check, the closing collective."""

    def __init__(self, rank: int, world_size: int, device: torch.device, ride: MarksRide):
        if ride not in (IN_FIRST_BUCKET, IN_FIRST_ALL_GATHER):
            raise ValueError(f"marks: expected {IN_FIRST_BUCKET!r} or {IN_FIRST_ALL_GATHER!r}, got {ride!r}")
        self.rank, self.world_size, self.device, self.ride = rank, world_size, device, ride
        # the shape of the collective that starts a step, (op, numel, dtype), which engine.close's collective takes;
        # whether the next all-gather starts a step and carries the marks (the first, and the first after gradients
        # were reduce-scattered)
        self._step_opener: tuple[str, int, torch.dtype] | None = None
        self._marks_due = True
        self._mismatch: tuple[list[tuple[int, ...]], Collective | None] | None = None  # a bucket's, for backward
        self.marking_steps = True  # off only to measure what the marks cost (benchmarks/collective_record_cost.py)

    def install(self) -> None:
        """Into the collective record (just reset): a step's first all-gather (FSDP's, in forward) carries the marks."""
        if self.ride == IN_FIRST_ALL_GATHER:
            RECORD.carriers["all_gather_single"] = self._all_gather_with_marks
            RECORD.carriers["reduce_scatter_single"] = self._gradients_reduced

    # --- in the first gradient bucket (ddp) --------------------------------------------------------------
    def due_in_bucket(self, index: int) -> bool:
        return self.ride == IN_FIRST_BUCKET and index == 0 and self.world_size > 1 and self.marking_steps

    def all_reduce_with_marks(self, buffer: torch.Tensor, entry: Collective | None) -> torch.futures.Future:
        """allreduce_hook's average, with this rank's step marks appended; checked when it completes."""
        self._step_opener = ("all_reduce", buffer.numel(), buffer.dtype)
        publish_soon()  # the launcher knows each rank's step even if a peer's mismatched collective aborts them
        marks = step_marks(RECORD, GRADIENTS, self.rank, self.world_size, buffer.dtype, buffer.device)
        combined = torch.cat([buffer / self.world_size, marks])
        future = dist.all_reduce(combined, async_op=True).get_future()

        def unpack(done: torch.futures.Future) -> torch.Tensor:
            summed = done.value()[0]
            buffer.copy_(summed[: buffer.numel()])
            carried = read_marks(summed[buffer.numel() :], self.world_size)
            if any(mark != carried[0] for mark in carried):
                # failing the bucket's future fails backward (DDP waits for it); the message is made there,
                # in the user's thread, with the other ranks' entries (checked_in_backward)
                self._mismatch = (carried, entry)
                raise CollectiveMismatch("the ranks' step marks differ")
            return buffer

        return future.then(unpack)

    def all_reduce_marks_alone(self) -> None:
        """The step marks in an all-reduce of their own (float32, exact below its mark modulus), checked when it
        completes: the first bucket's when its gradients cross compressed (compressed_buckets.py), where the marks
        cannot ride."""
        self._step_opener = ("all_reduce", 0, torch.float32)
        publish_soon()
        marks = step_marks(RECORD, GRADIENTS, self.rank, self.world_size, torch.float32, self.device)
        with RECORD.issuing("all_reduce of the step marks", marks.numel() * marks.element_size()) as entry:
            if entry is not None:
                entry.gradients = False  # (issued in backward, but not the gradients' exchange)
            dist.all_reduce(marks)
        carried = read_marks(marks, self.world_size)
        if any(mark != carried[0] for mark in carried):
            self._mismatch = (carried, entry)  # named in backward (checked_in_backward), in the user's thread
            raise CollectiveMismatch("the ranks' step marks differ")

    @contextlib.contextmanager
    def checked_in_backward(self) -> Iterator[None]:
        """Around a backward whose first bucket carries the marks: a bucket that found the ranks' marks differ
        failed backward; raise CollectiveMismatch instead, naming every rank's place."""
        self._mismatch = None
        try:
            yield
        except RuntimeError:
            if self._mismatch is None:
                raise
        if self._mismatch is not None:
            marks, entry = self._mismatch
            self.check(marks, entry)

    # --- in a step's first all-gather (fsdp), through the record's carriers ---------------------------
    def _gradients_reduced(self, reduce_scatter: Callable[..., R], entry: Collective, *args: Any, **kwargs: Any) -> R:
        self._marks_due = True  # the next all-gather starts a step
        return reduce_scatter(*args, **kwargs)

    def _all_gather_with_marks(
        self,
        gather: Callable[..., R],
        entry: Collective,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        *args: Any,
        **kw: Any,
    ) -> R:
        """FSDP's all_gather_single, the first of a step: preceded by a gather of every rank's step marks (a few
        elements), checked before the unit is gathered. The marks go in their own small gather, not appended to the
        unit's: appending would copy the unit's shard and its gathered buffer, a transient second copy of the
        step's first unit (the root, often the embeddings) at the memory peak."""
        group = kw.get("group", args[0] if args else None)
        if (
            not self._marks_due
            or not self.marking_steps
            or kw.get("async_op", args[1] if len(args) > 1 else False)
            or (group is not None and group.size() != self.world_size)  # a subgroup (hsdp): not checked here
            or not input_tensor.is_floating_point()
        ):
            return gather(output_tensor, input_tensor, *args, **kw)
        self._marks_due = False
        entry = RECORD.step_begins(entry)
        publish_soon()  # the launcher knows each rank's step even if a peer's mismatched collective aborts them
        self._step_opener = ("all_gather_single", 0, input_tensor.dtype)
        marks = step_marks(RECORD, GRADIENTS, self.rank, self.world_size, input_tensor.dtype, input_tensor.device)
        gathered = torch.empty(self.world_size * marks.numel(), dtype=marks.dtype, device=marks.device)
        gather(gathered, marks, group=group)
        self.check(read_marks(gathered.view(self.world_size, -1).sum(0), self.world_size), entry)
        del marks, gathered  # freed before the unit's gather, so the step's memory peak is the unit's alone
        return gather(output_tensor, input_tensor, *args, **kw)

    # --- the closing collective and the check -------------------------------------------------------
    def closing_collective(self) -> None:
        """What every rank does in teardown before the process group goes: the collective that starts a step
        (its shape as last seen: ddp's first bucket all-reduce, fsdp's first all-gather) carrying CLOSING marks
        (`check`), so a rank still training is told that this one ran out of batches instead of both
        waiting in different collectives; a barrier before any step."""
        if self._step_opener is None:
            with RECORD.issuing("barrier (engine.close)"):
                publish_now()
                dist.barrier()
            return
        op, numel, dtype = self._step_opener
        with RECORD.issuing(f"{op} (engine.close)") as entry:
            publish_now()
            marks = step_marks(RECORD, CLOSING, self.rank, self.world_size, dtype, self.device)
            combined = torch.cat([torch.zeros(numel, dtype=dtype, device=self.device), marks])
            if op == "all_reduce":
                dist.all_reduce(combined)
                summed = combined[numel:]
            else:
                gathered = torch.empty(self.world_size * combined.numel(), dtype=dtype, device=self.device)
                dist.all_gather_single(gathered, combined)
                summed = gathered.view(self.world_size, -1)[:, numel:].sum(0)
        self.check(read_marks(summed, self.world_size), entry)

    def check(self, marks: list[tuple[int, ...]], entry: Collective | None) -> None:
        """Raise CollectiveMismatch unless every rank carried the same marks: one line naming the ranks that
        differ, with each rank's last collective (exchanged through the rendezvous store)."""
        if all(mark == marks[0] for mark in marks):
            return
        raise CollectiveMismatch(mismatch_message(marks, self._exchange_entries(entry)))

    def _exchange_entries(self, entry: Collective | None) -> dict[int, dict[str, Any]]:
        """Every rank's record entry at the mismatch, through the store (no collective can be trusted now)."""
        entries = {self.rank: entry.as_dict()} if entry is not None else {}
        try:
            store = dist.distributed_c10d._get_default_store()
            key = f"dpkit/mismatch/{restart_count()}/{{}}"
            if entry is not None:
                store.set(key.format(self.rank), json.dumps(entry.as_dict()))
            others = [key.format(r) for r in range(self.world_size) if r != self.rank]
            store.wait(others, timedelta(seconds=_ENTRY_WAIT_SECONDS))
            for rank in range(self.world_size):
                if rank != self.rank:
                    entries[rank] = json.loads(store.get(key.format(rank)))
        except Exception as error:  # a rank that died or never got here: name what is known
            log.debug("the other ranks' record entries did not arrive: %s", error)
        return entries
