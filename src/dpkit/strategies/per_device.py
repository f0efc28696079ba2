"""What the strategies with one process per device share (ddp, fsdp); not a strategy itself.

Processes come from `dpkit launch` (torch.distributed.run), which sets RANK, WORLD_SIZE, LOCAL_RANK and
the rendezvous address. `PerDeviceStrategy` joins them in a process group (gloo on CPU, NCCL on GPUs),
tells the launcher's hang watch how far this rank is, and gives every process its share of each global
batch with the loss weight that makes the exchanged gradient the single-device one:

- Data: every process iterates the same global batches (same sampler order) and loads only its own
  contiguous share, sized by dpkit.split_sizes, so the shares of one step are exactly the global batch,
  and in evaluation every sample is seen once, by one process, with no padding duplicates.
- Weighting: DDP and FSDP average per-process mean losses' gradients, which over-weights the samples of a
  smaller share. Scaling each process's loss by n_rank * world / N before the average gives
  sum(n_rank / N * grad_rank), the single-device gradient of the mean over all N samples. The Engine's
  loader records n_rank and N with each batch it yields and asks `loss_weight` for the factor, which it
  passes to backward in `scale`.
Both rules are ProcessShares, which the data hooks (global_batches, batch_share, loss_weight) use.

Every collective is recorded while the strategy lives (observe/collectives.py: op, size, step, the user's
line), and each step's first collective carries every rank's place (the step marks: ddp's first gradient
bucket, fsdp's first all-gather), so ranks at different steps stop at once with one line naming both; the
closing collective (engine.close) takes that shape too, so a rank that ran out of batches is named as such.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

from dpkit.checks import check_int
from dpkit.devices import cpu_threads_per_device
from dpkit.launch.environment import (
    hang_timeout_seconds,
    launched,
    missing_launch_variables,
    process_place,
    restart_count,
)
from dpkit.launch.heartbeat import ProgressHeartbeat, publish_now, publish_soon
from dpkit.launch.rendezvous import rendezvous_store
from dpkit.observe.collectives import (
    CLOSING,
    GRADIENTS,
    RECORD,
    Collective,
    CollectiveMismatch,
    mismatch_message,
    read_marks,
    record_torch_collectives,
    step_marks,
    stop_recording_torch_collectives,
)
from dpkit.parallel.scatter import split_sizes
from dpkit.strategies.base import Strategy

log = logging.getLogger("dpkit")
T = TypeVar("T")
R = TypeVar("R")  # what a torch collective returns (its work handle, or None)


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


class ProcessShares:
    """The data rule, apart from the processes so it can be checked without them: every process iterates
    the same global batches, in the same order, loads its contiguous share of each (sizes by split_sizes),
    and scales its mean loss by its share (`loss_weight`)."""

    def __init__(self, rank: int, world_size: int, seed: int):
        self.rank, self.world_size, self.seed = rank, world_size, seed

    def global_batches(self, loader: DataLoader) -> Iterable[list[int]] | None:
        if isinstance(loader.sampler, DistributedSampler):
            raise ValueError(
                "loader: do not pass a DistributedSampler; engine.setup_dataloader gives each process its share of "
                "every global batch itself (give the loader the global batch size)"
            )
        sampler = loader.sampler
        if (
            type(sampler) is RandomSampler
            and sampler.generator is None
            and loader.generator is None
            and not sampler.replacement
            # a map-style dataset (resumable() checked) has a length; torch's Dataset type does not say so
            and sampler.num_samples == len(loader.dataset)  # type: ignore[arg-type]
            and loader.batch_size is not None  # (a resumable loader's sampler batches by it)
        ):
            # the global RNG may differ between processes; draw the order from (seed, epoch) instead
            shuffle: DistributedSampler[int] = DistributedSampler(
                loader.dataset, num_replicas=1, rank=0, shuffle=True, seed=self.seed
            )
            return BatchSampler(shuffle, loader.batch_size, loader.drop_last)
        return loader.batch_sampler

    def batch_share(self, indices: list[int]) -> list[int]:
        sizes = split_sizes(len(indices), self.world_size)
        if sizes[self.rank] == 0:
            raise ValueError(
                f"batch_size: a global batch of {len(indices)} samples "
                f"cannot give each of {self.world_size} processes a "
                "sample; use a batch size of at least the world size, or drop_last=True"
            )
        start = sum(sizes[: self.rank])
        return indices[start : start + sizes[self.rank]]

    def loss_weight(self, rows: int, global_rows: int) -> float:
        # the gradients are averaged over processes; n_rank * world / N turns that into sum(n_rank / N * grad_rank)
        return rows * self.world_size / global_rows


# wrapped modules whose process group was destroyed: see PerDeviceStrategy.teardown
_KEPT_UNTIL_EXIT: list[nn.Module] = []
# how long a rank that found a mismatch waits for the others' record entries (they found it at the same moment)
_ENTRY_WAIT_SECONDS = 5.0
# how long teardown gives the GIL away for gloo's threads to release their last collectives: see teardown
_GLOO_RELEASE_SECONDS = 0.05


@dataclass(frozen=True)
class ProcessGroupOptions:
    """The options every strategy with a process per device takes (`Engine(strategy=..., **options)`), declared
    here once: ddp, fsdp, zero and hsdp add only their own."""

    timeout_seconds: float = 300.0  # a collective whose peer died fails after this (not torch's 30 minutes)
    seed: int = 0  # the data order's seed (rank 0's, broadcast): every process draws the same global batches
    threads_per_device: int | None = None  # intra-op threads per process; None: a fair share of the cores
    init_timeout_seconds: float = 60.0  # how long to wait for every rank to join
    find_unused_parameters: bool = False  # steps may leave trainable parameters without a gradient

    def __post_init__(self) -> None:
        if not isinstance(self.find_unused_parameters, bool):
            raise TypeError(
                "find_unused_parameters: expected True (steps may leave trainable parameters without a gradient) "
                f"or False, got {self.find_unused_parameters!r}"
            )
        if self.threads_per_device is not None:
            check_int(self.threads_per_device, "threads_per_device", meaning="intra-op threads per process")


class PerDeviceStrategy(Strategy):
    """One process per device, joined in a process group: the data, the collectives and the teardown that
    ddp and fsdp share. A subclass wraps the model (keeping what holds the process group in `self.wrapped`)."""

    options: ClassVar[tuple[str, ...]] = tuple(option.name for option in fields(ProcessGroupOptions))
    # where a step's marks ride (observe/collectives.py): a step's first all-gather (fsdp); ddp carries them in
    # its first gradient bucket instead
    marks_in_all_gather: ClassVar[bool] = True

    def __init__(self, devices: Sequence[torch.device], *, precision: str = "32", **group_options: Any):
        options = ProcessGroupOptions(**group_options)  # (the registry checked the names)
        if not launched():
            raise RuntimeError(
                f"strategy='{self.name}' runs one process per device, and this process was not started by a launcher "
                f"({', '.join(missing_launch_variables())} unset); start the script with "
                f"`dpkit launch --nproc-per-node N script.py ...` (dpkit train --strategy {self.name} does this itself)"
            )
        super().__init__(devices, precision=precision)
        place = process_place()
        self.rank = place.rank
        self.world_size = place.world_size
        self.local_rank = place.local_rank
        # a launcher that does not say how many processes share this node: one per device given
        self.local_world_size = place.local_world_size or len(self.devices)
        if self.local_world_size != len(self.devices):
            raise ValueError(
                f"devices: {len(self.devices)} devices but the launcher started "
                f"{self.local_world_size} processes on this "
                f"node; pass devices={self.local_world_size} or launch with --nproc-per-node {len(self.devices)}"
            )
        self.device = self.devices[self.local_rank]
        self.threads_per_device = options.threads_per_device
        self.timeout_seconds = options.timeout_seconds
        self.init_timeout_seconds = options.init_timeout_seconds
        self.seed = options.seed
        # ddp hands it to torch's DistributedDataParallel; FSDP2 needs nothing (see each strategy's docstring)
        self.find_unused_parameters = options.find_unused_parameters
        self._process_shares: ProcessShares | None = None
        self._heartbeat: ProgressHeartbeat | None = None
        self.wrapped: nn.Module | None = None  # the wrapped model, which holds on to the process group
        # the step check: the shape of the collective that starts a step, (op, numel, dtype), which engine.close's
        # collective takes; whether the next all-gather starts a step and carries the marks (the first, and the
        # first after gradients were reduce-scattered)
        self._step_opener: tuple[str, int, torch.dtype] | None = None
        self._marks_due = True
        self.marking_steps = True  # off only to measure what the marks cost (benchmarks/collective_record_cost.py)

    @property
    def root_device(self) -> torch.device:
        return self.device

    def setup_environment(self) -> None:
        if self.device.type == "cpu":
            torch.set_num_threads(self.threads_per_device or cpu_threads_per_device(self.local_world_size))
        else:
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            backend = "gloo" if self.device.type == "cpu" else "nccl"
            # every rank's arrival is awaited in short, interruptible waits, at most init_timeout_seconds
            store = rendezvous_store(
                self.rank,
                self.world_size,
                wait_seconds=min(self.init_timeout_seconds, self.timeout_seconds),
                timeout_seconds=self.timeout_seconds,
            )
            # a bounded timeout: a collective whose peer died fails instead of waiting for the default 30 minutes
            dist.init_process_group(
                backend,
                store=store,
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=self.timeout_seconds),
            )
        # every collective from here on is recorded (observe/collectives.py), until teardown; a step's first
        # all-gather (FSDP's, in forward) carries the step marks
        RECORD.reset()
        if self.marks_in_all_gather:
            RECORD.carriers["all_gather_single"] = self._all_gather_with_marks
            RECORD.carriers["reduce_scatter_single"] = self._gradients_reduced
        record_torch_collectives()
        hang_timeout = hang_timeout_seconds()
        if hang_timeout is not None:
            # the launcher watches for a rank that stops making progress; tell it how far this one is
            self._heartbeat = ProgressHeartbeat(self.rank, interval_seconds=min(1.0, hang_timeout / 4)).start()
        if self.rank != 0 and not any(isinstance(f, _BelowWarning) for f in log.filters):
            log.addFilter(_BelowWarning())

    # --- the data: ProcessShares, with rank 0's seed ----------------------------------------------------
    def _shares(self) -> ProcessShares:
        if self._process_shares is None:  # every process asks at the same point (setting up a loader): a collective
            seed = torch.tensor([self.seed], dtype=torch.int64, device=self.collective_device())
            dist.broadcast(seed, src=0)
            self._process_shares = ProcessShares(self.rank, self.world_size, int(seed.item()))
        return self._process_shares

    def global_batches(self, loader: DataLoader) -> Iterable[list[int]] | None:
        return self._shares().global_batches(loader)

    def batch_share(self, indices: list[int]) -> list[int]:
        return self._shares().batch_share(indices)

    def loss_weight(self, rows: int, global_rows: int) -> float:
        # asked once per batch an Engine loader yields, in step with the user's loop: the record's step
        RECORD.batches += 1
        return self._shares().loss_weight(rows, global_rows)

    # --- collectives -------------------------------------------------------------------------------
    def collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    # the user's collectives (engine.reduce, gather, barrier, close) are told to the launcher before they start:
    # one a peer does not join may end in the backend aborting the process, and the report still names it
    def all_gather_object(self, obj: T) -> list[T]:
        gathered: list[Any] = [None] * self.world_size  # what torch unpickles: each process's `obj`
        with RECORD.issuing("all_gather_object"):
            publish_now()
            dist.all_gather_object(gathered, obj)
        return gathered

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        result = tensor.detach().to(self.collective_device(), copy=True)
        with RECORD.issuing("all_reduce", result.numel() * result.element_size()):
            publish_now()
            dist.all_reduce(result, op=dist.ReduceOp.SUM)
        return result / self.world_size if op == "mean" else result

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's rows, concatenated in rank order (uneven row counts allowed)."""
        local = tensor.detach().to(self.collective_device())
        rows = torch.tensor([local.shape[0]], dtype=torch.int64, device=local.device)
        all_rows = [torch.zeros_like(rows) for _ in range(self.world_size)]
        with RECORD.issuing("all_gather of rows", local.numel() * local.element_size()):
            publish_now()
            dist.all_gather(all_rows, rows)
            counts = [int(r.item()) for r in all_rows]
            padded = torch.zeros((max(counts),) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device)
            padded[: local.shape[0]] = local
            parts = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(parts, padded)
        return torch.cat([part[:count] for part, count in zip(parts, counts)]).to(tensor.device)

    def barrier(self) -> None:
        with RECORD.issuing("barrier"):
            publish_now()
            dist.barrier()

    # --- the step check (observe/collectives.py): marks carried in a collective every rank makes ----------
    def _closing_collective(self) -> None:
        """What every rank does in teardown before the process group goes: the collective that starts a step
        (its shape as last seen: ddp's first bucket all-reduce, fsdp's first all-gather) carrying CLOSING marks
        (`check_marks`), so a rank still training is told that this one ran out of batches instead of both
        waiting in different collectives; a barrier before any step."""
        if self._step_opener is None:
            with RECORD.issuing("barrier (engine.close)"):
                publish_now()
                dist.barrier()
            return
        op, numel, dtype = self._step_opener
        device = self.collective_device()
        with RECORD.issuing(f"{op} (engine.close)") as entry:
            publish_now()
            marks = step_marks(RECORD, CLOSING, self.rank, self.world_size, dtype, device)
            combined = torch.cat([torch.zeros(numel, dtype=dtype, device=device), marks])
            if op == "all_reduce":
                dist.all_reduce(combined)
                summed = combined[numel:]
            else:
                gathered = torch.empty(self.world_size * combined.numel(), dtype=dtype, device=device)
                dist.all_gather_single(gathered, combined)
                summed = gathered.view(self.world_size, -1)[:, numel:].sum(0)
        self.check_marks(read_marks(summed, self.world_size), entry)

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
        self.check_marks(read_marks(gathered.view(self.world_size, -1).sum(0), self.world_size), entry)
        del marks, gathered  # freed before the unit's gather, so the step's memory peak is the unit's alone
        return gather(output_tensor, input_tensor, *args, **kw)

    def check_marks(self, marks: list[tuple[int, ...]], entry: Collective | None) -> None:
        """Raise CollectiveMismatch unless every rank carried the same marks: one line naming the ranks that
        differ, with each rank's last collective (exchanged through the rendezvous store)."""
        if all(mark == marks[0] for mark in marks):
            return
        raise CollectiveMismatch(mismatch_message(marks, self._exchange_entries(entry)))

    def _exchange_entries(self, entry: Collective | None) -> dict[int, dict[str, Any]]:
        """Every rank's record entry at the mismatch, through the store (no collective can be trusted now)."""
        import json

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

    def teardown(self) -> None:
        if dist.is_initialized():
            # every rank arrives before any closes its connections: a rank that tears gloo down while a
            # peer is still finishing its last collective can abort at exit ("terminate called ...");
            # the heartbeat runs until every rank arrived, so a rank that hangs before it is still caught
            try:
                self._closing_collective()
            finally:
                self._stop_heartbeat()
                stop_recording_torch_collectives()
            if self.wrapped is not None:
                # Freeing DDP's Reducer right away frees the gloo process group, whose destructor joins gloo's
                # worker thread while holding the GIL; if that thread is still freeing a finished work that
                # holds Python tensors (all_gather_object's), it waits for the GIL: a deadlock, seen under load
                # at the end of `dpkit profile --strategy ddp`. Kept for the life of the process instead.
                _KEPT_UNTIL_EXIT.append(self.wrapped)
            dist.destroy_process_group()
            # gloo's worker threads drop their last collectives (the barrier's, and the all-reduce it waited
            # for) just after those completed; a tensor Python once held (DDP's bucket, which went through
            # the comm hook) takes the GIL to be freed. Should the script end within those moments, the
            # thread takes the GIL while the interpreter finalizes, CPython ends it (pthread_exit), and in
            # C++ that is std::terminate: "terminate called without an active exception", SIGABRT at exit.
            # Giving the GIL away for a moment lets them finish first.
            time.sleep(_GLOO_RELEASE_SECONDS)
        self._stop_heartbeat()
        stop_recording_torch_collectives()
        self.wrapped = None

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
