"""ddp: torch's DistributedDataParallel, one process per device; gloo on CPU, NCCL on GPUs.

Processes come from `dpkit launch` (torch.distributed.run), which sets RANK, WORLD_SIZE, LOCAL_RANK and
the rendezvous address. Each process keeps one replica; DDP all-reduces gradient buckets while backward
runs. Two things plain DDP gets wrong for a global batch, fixed here:

- Data: every process iterates the same global batches (same sampler order) and loads only its own
  contiguous share, sized by dpkit.split_sizes, so the shares of one step are exactly the global batch,
  and in evaluation every sample is seen once, by one process, with no padding duplicates.
- Weighting: DDP averages per-process mean losses, which over-weights the samples of a smaller share.
  Scaling each process's loss by n_rank * world / N before DDP's average gives sum(n_rank / N * grad_rank),
  the single-device gradient of the mean over all N samples.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from datetime import timedelta
from typing import Any, ContextManager, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler

from dpkit.devices import cpu_threads_per_device
from dpkit.launch import LAUNCH_VARIABLES, launched
from dpkit.parallel import hooks
from dpkit.parallel.scatter import split_sizes
from dpkit.strategies.base import Strategy
from dpkit.strategies.single import one_device_forward

log = logging.getLogger("dpkit")

class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


class EpochShuffle(Sampler[int]):
    """A permutation that depends only on (seed, epoch), so every process draws the same one."""

    def __init__(self, length: int, seed: int):
        self.length, self.seed, self.epoch = length, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.length, generator=generator).tolist())

    def __len__(self) -> int:
        return self.length


class RankShares(Sampler[list[int]]):
    """This process's contiguous share of every global batch, recording (share, global size) per batch."""

    def __init__(self, global_batches: Any, rank: int, world_size: int):
        self.global_batches, self.rank, self.world_size = global_batches, rank, world_size
        self.sizes: collections.deque[tuple[int, int]] = collections.deque()

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches:
            batch = list(batch)
            sizes = split_sizes(len(batch), self.world_size)
            if sizes[self.rank] == 0:
                raise ValueError(
                    f"batch_size: a global batch of {len(batch)} samples cannot give each of {self.world_size} processes a "
                    "sample; use a batch size of at least the world size, or drop_last=True"
                )
            start = sum(sizes[:self.rank])
            self.sizes.append((sizes[self.rank], len(batch)))
            yield batch[start:start + sizes[self.rank]]

    def __len__(self) -> int:
        return len(self.global_batches)


class ShardedLoader:
    """Iterates a DataLoader's global batches, yielding this process's share; set_epoch each epoch."""

    def __init__(self, loader: DataLoader, strategy: "DDP", seed: int):
        if not isinstance(loader, DataLoader):
            raise TypeError(f"loader: strategy 'ddp' shards a torch DataLoader's batches, got {type(loader).__name__}")
        if isinstance(loader.sampler, DistributedSampler):
            raise ValueError(
                "loader: do not pass a DistributedSampler; engine.setup_dataloader gives each process its share of "
                "every global batch itself (give the loader the global batch size)"
            )
        if loader.batch_sampler is None:
            raise ValueError("loader: strategy 'ddp' needs batches of indices; create the DataLoader with batch_size= or batch_sampler=")
        self.strategy = strategy
        self.epoch = 0
        self.shuffle: EpochShuffle | None = None
        global_batches = loader.batch_sampler
        sampler = loader.sampler
        if (type(sampler) is RandomSampler and sampler.generator is None and not sampler.replacement
                and sampler.num_samples == len(loader.dataset)):
            # the global RNG may differ between processes; draw the order from (seed, epoch) instead
            self.shuffle = EpochShuffle(len(loader.dataset), seed)
            global_batches = BatchSampler(self.shuffle, loader.batch_size, loader.drop_last)
        self.shares = RankShares(global_batches, strategy.rank, strategy.world_size)
        extra = {"prefetch_factor": loader.prefetch_factor, "persistent_workers": loader.persistent_workers} if loader.num_workers > 0 else {}
        self.loader = DataLoader(
            loader.dataset, batch_sampler=self.shares, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context, **extra,
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        if self.shuffle is not None:
            self.shuffle.set_epoch(self.epoch)
        sampler = getattr(self.shares.global_batches, "sampler", None)
        if sampler is not None and sampler is not self.shuffle and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        self.epoch += 1
        self.shares.sizes.clear()
        try:
            for batch in self.loader:
                self.strategy.shares = self.shares.sizes.popleft()
                yield batch
        finally:
            self.strategy.shares = None

    def __len__(self) -> int:
        return len(self.loader)


class DDP(Strategy):
    name = "ddp"

    def __init__(self, devices: Sequence[torch.device], *, timeout_seconds: float = 300.0, seed: int = 0,
                 threads_per_device: int | None = None):
        if not launched():
            raise RuntimeError(
                "strategy='ddp' runs one process per device, and this process was not started by a launcher "
                f"({', '.join(n for n in LAUNCH_VARIABLES if n not in os.environ)} unset); start the script with "
                "`dpkit launch --nproc-per-node N script.py ...` (dpkit train --strategy ddp does this itself)"
            )
        super().__init__(devices)
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", len(self.devices)))
        if self.local_world_size != len(self.devices):
            raise ValueError(
                f"devices: {len(self.devices)} devices but the launcher started {self.local_world_size} processes on this "
                f"node; pass devices={self.local_world_size} or launch with --nproc-per-node {len(self.devices)}"
            )
        self.device = self.devices[self.local_rank]
        if threads_per_device is not None and (isinstance(threads_per_device, bool) or not isinstance(threads_per_device, int) or threads_per_device < 1):
            raise ValueError(f"threads_per_device: expected a positive int of intra-op threads per process, got {threads_per_device!r}")
        self.threads_per_device = threads_per_device
        self.timeout_seconds = timeout_seconds
        self.seed = seed
        self.shares: tuple[int, int] | None = None  # (this process's rows, global rows) of the batch in hand
        self.ddp: nn.parallel.DistributedDataParallel | None = None
        self.bucket_seconds: list[tuple[float, float]] = []  # (launched, reduced) per bucket, while observed

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
            # a bounded timeout: a collective whose peer died fails instead of waiting for the default 30 minutes
            dist.init_process_group(backend, timeout=timedelta(seconds=self.timeout_seconds))
        if self.rank != 0 and not any(isinstance(f, _BelowWarning) for f in log.filters):
            log.addFilter(_BelowWarning())

    def wrap_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        # torch's own all-reduce hook (the same arithmetic as DDP's default), timed while anyone listens
        self.ddp.register_comm_hook(None, self._all_reduce_bucket)
        return self.ddp

    def _all_reduce_bucket(self, state, bucket):  # unannotated: torch checks annotations against its own classes
        reduced = allreduce_hook(state, bucket)
        if not hooks.listening():
            return reduced
        launched = time.perf_counter()

        def finished(future: torch.futures.Future) -> torch.Tensor:
            # runs in the backend's thread when the bucket's all-reduce completed (host time: on CUDA an
            # approximation of when the collective finished on the stream)
            self.bucket_seconds.append((launched, time.perf_counter()))
            return future.value()

        return reduced.then(finished)

    def announce_all_reduce(self) -> None:
        """Tell listeners the all-reduce time of the backward that just ended, and the part of it hidden
        behind backward's computation (which ends when the last bucket is ready, i.e. launched)."""
        buckets, self.bucket_seconds = sorted(self.bucket_seconds), []
        if not buckets:
            return
        compute_end = max(launched for launched, _ in buckets)
        merged: list[list[float]] = []  # buckets in flight at once count once
        for launched, reduced in buckets:
            if merged and launched <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], reduced)
            else:
                merged.append([launched, reduced])
        for launched, reduced in merged:
            hidden = max(0.0, min(reduced, compute_end) - launched)
            hooks.span("all_reduce", self.device, launched, reduced - launched, hidden)

    def forward_context(self, args: tuple, kwargs: dict) -> ContextManager:
        return one_device_forward(self.ddp.module if self.ddp is not None else None, self.device, args, kwargs)

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def wrap_dataloader(self, loader: Any) -> ShardedLoader:
        seed = torch.tensor([self.seed], dtype=torch.int64, device=self._collective_device())
        dist.broadcast(seed, src=0)
        return ShardedLoader(loader, self, int(seed.item()))

    def backward(self, loss: torch.Tensor, *, scale: float, sync: bool) -> None:
        if self.shares is not None:
            rows, global_rows = self.shares
            scale = scale * rows * self.world_size / global_rows
        skip_sync = self.ddp.no_sync() if (not sync and self.ddp is not None) else contextlib.nullcontext()
        with skip_sync, hooks.phase("backward", self.device):  # includes waiting for the last buckets' all-reduce
            (loss * scale if scale != 1.0 else loss).backward()
        self.announce_all_reduce()

    # --- collectives -------------------------------------------------------------------------------
    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        result = tensor.detach().to(self._collective_device(), copy=True)
        dist.all_reduce(result, op=dist.ReduceOp.SUM)
        return result / self.world_size if op == "mean" else result

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's rows, concatenated in rank order (uneven row counts allowed)."""
        local = tensor.detach().to(self._collective_device())
        rows = torch.tensor([local.shape[0]], dtype=torch.int64, device=local.device)
        all_rows = [torch.zeros_like(rows) for _ in range(self.world_size)]
        dist.all_gather(all_rows, rows)
        counts = [int(r.item()) for r in all_rows]
        padded = torch.zeros((max(counts),) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat([part[:count] for part, count in zip(parts, counts)]).to(tensor.device)

    def barrier(self) -> None:
        dist.barrier()

    def teardown(self) -> None:
        if dist.is_initialized():
            # every rank arrives before any closes its connections: a rank that tears gloo down while a
            # peer is still finishing its last collective can abort at exit ("terminate called ...")
            dist.barrier()
            dist.destroy_process_group()
        self.ddp = None
