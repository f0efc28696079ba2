"""ddp: torch's DistributedDataParallel, one process per device; gloo on CPU, NCCL on GPUs.

Each process keeps one replica; DDP all-reduces gradient buckets while backward runs. The processes, the
data rule (every process loads its contiguous share of each global batch) and the loss weight that makes
DDP's average the single-device gradient on uneven shares come from per_device.PerDeviceStrategy.
"""

from __future__ import annotations

import contextlib
import time
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from dpkit.parallel import hooks
from dpkit.strategies.base import ON_ROOT, PER_DEVICE, PERSISTENT, Traits
from dpkit.strategies.per_device import PerDeviceStrategy
from dpkit.strategies.single import one_device_forward


class DDP(PerDeviceStrategy):
    name = "ddp"
    traits = Traits(processes=PER_DEVICE, loss=ON_ROOT, replicas=PERSISTENT)
    wrapped: nn.parallel.DistributedDataParallel | None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.wrapped = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        self.bucket_seconds: list[tuple[float, float]] = []  # (started, reduced) per bucket, while observed
        # torch's own all-reduce hook (the same arithmetic as DDP's default), timed while anyone listens
        self.wrapped.register_comm_hook(None, self._all_reduce_bucket)
        return self.wrapped

    def _all_reduce_bucket(self, state, bucket):  # unannotated: torch checks annotations against its own classes
        reduced = allreduce_hook(state, bucket)
        if not hooks.listening():
            return reduced
        started = time.perf_counter()

        def finished(future: torch.futures.Future) -> torch.Tensor:
            # runs in the backend's thread when the bucket's all-reduce completed (host time: on CUDA an
            # approximation of when the collective finished on the stream)
            self.bucket_seconds.append((started, time.perf_counter()))
            return future.value()

        return reduced.then(finished)

    def announce_all_reduce(self) -> None:
        """Tell listeners the all-reduce time of the backward that just ended, and the part of it hidden
        behind backward's computation (which ends when the last bucket is ready, i.e. launched)."""
        buckets, self.bucket_seconds = sorted(getattr(self, "bucket_seconds", [])), []
        if not buckets:
            return
        compute_end = max(started for started, _ in buckets)
        merged: list[list[float]] = []  # buckets in flight at once count once
        for started, reduced in buckets:
            if merged and started <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], reduced)
            else:
                merged.append([started, reduced])
        for started, reduced in merged:
            hidden = max(0.0, min(reduced, compute_end) - started)
            hooks.span("all_reduce", self.device, started, reduced - started, hidden)

    def forward_context(self, args: tuple, kwargs: dict) -> AbstractContextManager:
        return one_device_forward(self.wrapped.module if self.wrapped is not None else None, self.device, args, kwargs)

    def backward(self, loss: torch.Tensor, *, scale: float, sync: bool) -> None:
        # `scale` includes this process's loss weight (its rows * world / global rows, from the batch's record)
        skip_sync = self.wrapped.no_sync() if (not sync and self.wrapped is not None) else contextlib.nullcontext()
        with skip_sync, hooks.phase("backward", self.device):  # includes waiting for the last buckets' all-reduce
            (loss * scale if scale != 1.0 else loss).backward()
        self.announce_all_reduce()
