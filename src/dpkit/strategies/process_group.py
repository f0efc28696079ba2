"""The process group the strategies with a process per device compose (ddp, fsdp, zero, hsdp): not a strategy.

Processes come from `dpkit launch` (torch.distributed.run), which sets RANK, WORLD_SIZE, LOCAL_RANK and
the rendezvous address. `ProcessGroup`, configured by one frozen `ProcessGroupOptions`, owns what they share:

- init and rendezvous: gloo on CPU, NCCL on GPUs, every rank awaited in short, interruptible waits;
- the heartbeat: tells the launcher's hang watch how far this rank is;
- the data rule's seed: rank 0's, broadcast, for ProcessShares (process_shares.py);
- the user's collectives (engine.reduce, gather, barrier), told to the launcher before they start;
- the step marks (step_marks.py): every collective is recorded while the group lives (observe/collectives.py:
  op, size, step, the user's line), and each step's first collective carries every rank's place, in the
  collective the strategy chose (ddp's first gradient bucket, fsdp's first all-gather);
- teardown: the closing collective (engine.close), then the process group destroyed, with gloo's workarounds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from dpkit.checks import check_int
from dpkit.devices import cpu_threads_per_device
from dpkit.launch.environment import hang_timeout_seconds
from dpkit.launch.heartbeat import ProgressHeartbeat, publish_now
from dpkit.launch.rendezvous import rendezvous_store
from dpkit.observe.collectives import RECORD, record_torch_collectives, stop_recording_torch_collectives
from dpkit.strategies.compression import Compression, parse_compression
from dpkit.strategies.process_shares import ProcessShares
from dpkit.strategies.step_marks import MarksRide, StepMarks

log = logging.getLogger("dpkit")
T = TypeVar("T")

# wrapped modules whose process group was destroyed: see ProcessGroup.close
_KEPT_UNTIL_EXIT: list[nn.Module] = []
# how long teardown gives the GIL away for gloo's threads to release their last collectives: see close
_GLOO_RELEASE_SECONDS = 0.05


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


@dataclass(frozen=True)
class ProcessGroupOptions:
    """The options every strategy with a process per device takes (`Engine(strategy=..., **options)`), declared
    here once: ddp, fsdp, zero and hsdp add only their own."""

    timeout_seconds: float = 300.0  # a collective whose peer died fails after this (not torch's 30 minutes)
    seed: int = 0  # the data order's seed (rank 0's, broadcast): every process draws the same global batches
    threads_per_device: int | None = None  # intra-op threads per process; None: a fair share of the cores
    init_timeout_seconds: float = 60.0  # how long to wait for every rank to join
    find_unused_parameters: bool = False  # steps may leave trainable parameters without a gradient
    # gradient compression (compression.py): "none", "bf16", "fp16", "powersgd" or "powersgd:R", and PowerSGD's
    # synchronized steps uncompressed first (None: compression.DEFAULT_WARMUP_STEPS)
    compress: str | Compression = "none"
    compress_warmup_steps: int | None = None

    @property
    def compression(self) -> Compression:
        return parse_compression(self.compress, self.compress_warmup_steps)

    def __post_init__(self) -> None:
        self.compression  # noqa: B018 (checked here: a bad value is one line before any process group)
        if not isinstance(self.find_unused_parameters, bool):
            raise TypeError(
                "find_unused_parameters: expected True (steps may leave trainable parameters without a gradient) "
                f"or False, got {self.find_unused_parameters!r}"
            )
        if self.threads_per_device is not None:
            check_int(self.threads_per_device, "threads_per_device", meaning="intra-op threads per process")


class ProcessGroup:
    """This process's place among the processes (rank, world size, the processes on its node, its device),
    joined by `start` and left by `close`; the step marks ride in the collective `marks` names."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        local_world_size: int,
        device: torch.device,
        options: ProcessGroupOptions,
        marks: MarksRide,
    ):
        self.rank, self.world_size, self.local_world_size = rank, world_size, local_world_size
        self.device = device
        self.options = options
        self.marks = StepMarks(rank, world_size, self.collective_device(), marks)
        self._shares: ProcessShares | None = None
        self._heartbeat: ProgressHeartbeat | None = None

    def collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    # --- joining -------------------------------------------------------------------------------------
    def start(self) -> None:
        """This process's threads or GPU, the process group joined, the record and the heartbeat started."""
        options = self.options
        if self.device.type == "cpu":
            torch.set_num_threads(options.threads_per_device or cpu_threads_per_device(self.local_world_size))
        else:
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            backend = "gloo" if self.device.type == "cpu" else "nccl"
            # every rank's arrival is awaited in short, interruptible waits, at most init_timeout_seconds
            store = rendezvous_store(
                self.rank,
                self.world_size,
                wait_seconds=min(options.init_timeout_seconds, options.timeout_seconds),
                timeout_seconds=options.timeout_seconds,
            )
            # a bounded timeout: a collective whose peer died fails instead of waiting for the default 30 minutes
            dist.init_process_group(
                backend,
                store=store,
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=options.timeout_seconds),
            )
        # every collective from here on is recorded (observe/collectives.py), until close; the marks' carriers too
        RECORD.reset()
        self.marks.install()
        record_torch_collectives()
        hang_timeout = hang_timeout_seconds()
        if hang_timeout is not None:
            # the launcher watches for a rank that stops making progress; tell it how far this one is
            self._heartbeat = ProgressHeartbeat(self.rank, interval_seconds=min(1.0, hang_timeout / 4)).start()
        if self.rank != 0 and not any(isinstance(f, _BelowWarning) for f in log.filters):
            log.addFilter(_BelowWarning())

    # --- the data rule, with rank 0's seed -----------------------------------------------------------
    def shares(self) -> ProcessShares:
        if self._shares is None:  # every process asks at the same point (setting up a loader): a collective
            seed = torch.tensor([self.options.seed], dtype=torch.int64, device=self.collective_device())
            dist.broadcast(seed, src=0)
            self._shares = ProcessShares(self.rank, self.world_size, int(seed.item()))
        return self._shares

    def loss_weight(self, rows: int, global_rows: int) -> float:
        # asked once per batch an Engine loader yields, in step with the user's loop: the record's step
        RECORD.batches += 1
        return self.shares().loss_weight(rows, global_rows)

    # --- the user's collectives: told to the launcher before they start, since one a peer does not join may
    # end in the backend aborting the process, and the report still names it ----------------------------
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

    # --- leaving -------------------------------------------------------------------------------------
    def close(self, wrapped: nn.Module | None) -> None:
        """The closing collective, then the process group destroyed; `wrapped` (the model that holds on to the
        process group) is kept for the life of the process (see below)."""
        if dist.is_initialized():
            # every rank arrives before any closes its connections: a rank that tears gloo down while a
            # peer is still finishing its last collective can abort at exit ("terminate called ...");
            # the heartbeat runs until every rank arrived, so a rank that hangs before it is still caught
            try:
                self.marks.closing_collective()
            finally:
                self._stop_heartbeat()
                stop_recording_torch_collectives()
            if wrapped is not None:
                # Freeing DDP's Reducer right away frees the gloo process group, whose destructor joins gloo's
                # worker thread while holding the GIL; if that thread is still freeing a finished work that
                # holds Python tensors (all_gather_object's), it waits for the GIL: a deadlock, seen under load
                # at the end of `dpkit profile --strategy ddp`. Kept for the life of the process instead.
                _KEPT_UNTIL_EXIT.append(wrapped)
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

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
