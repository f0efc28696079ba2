"""ddp: torch's DistributedDataParallel, one process per device; gloo on CPU, NCCL on GPUs.

Each process keeps one replica; DDP all-reduces gradient buckets while backward runs. The processes, the
data rule (every process loads its contiguous share of each global batch) and the loss weight that makes
DDP's average the single-device gradient on uneven shares come from per_device.PerDeviceStrategy and the
process group it composes.

Every bucket's all-reduce is recorded (observe/collectives.py). The first bucket of each step (DDP launches
buckets in index order, so bucket 0's all-reduce is the step's first collective) carries every rank's place
(batches, steps, collective sequence: the process group's step marks, which ddp tells it ride there): ranks
that disagree stop in backward, before the optimizer steps, with one line naming both; engine.close's
collective takes bucket 0's shape, so a rank still training is told that another ran out of batches instead
of waiting in a collective nobody joins.

Unused parameters: DDP's reducer waits for every trainable parameter's gradient; a step whose backward leaves
one without (a branch not taken, a head of another task) leaves its bucket unreduced and torch fails only at
the next forward ("Expected to have finished reduction in the prior iteration"), after the optimizer stepped
on gradients that were not averaged. Without find_unused_parameters, a hook on each trainable parameter notes
those that got a gradient in the step's synchronizing backward, and backward stops with one line naming the
others and the option, before the optimizer steps. The check needs no collective: a parameter left out on
every rank is named by every rank at once, and one left out on some ranks only leaves the others waiting in
that bucket's all-reduce (what no flag exchanged after backward could reach), so the ranks that left it out
name it and the launcher stops the group. find_unused_parameters=True (DDP searches the autograd graph after
each forward and marks the parameters it left out ready; one no rank used keeps no gradient, as on one device)
or static_graph=True (the same parameters unused in every step, learned in the first) go to DDP and turn the
check off.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from dpkit.observe.collectives import RECORD
from dpkit.parallel import hooks
from dpkit.strategies.base import ON_ROOT, PER_DEVICE, PERSISTENT, Traits
from dpkit.strategies.compressed_buckets import CompressedBuckets
from dpkit.strategies.compressed_sum import CompressedSum, load_saved_exchange, saved_exchange
from dpkit.strategies.per_device import PerDeviceStrategy
from dpkit.strategies.single import one_device_forward
from dpkit.strategies.step_marks import IN_FIRST_BUCKET

# torch's DDP communication hook: hook(state, bucket) -> a Future of the bucket's reduced buffer
CommHook = Callable[[Any, Any], torch.futures.Future]


class DDP(PerDeviceStrategy):
    name = "ddp"
    traits = Traits(processes=PER_DEVICE, loss=ON_ROOT, replicas=PERSISTENT)
    options = PerDeviceStrategy.options + ("static_graph", "bucket_cap_mb", "ddp_comm_hook")
    wrapped: nn.parallel.DistributedDataParallel | None
    # names shown in the unused-parameter line before "and N more"
    UNUSED_NAMES_SHOWN = 3

    def __init__(
        self,
        devices: Sequence[torch.device],
        *,
        static_graph: bool = False,
        bucket_cap_mb: float | None = None,
        ddp_comm_hook: CommHook | tuple[object, CommHook] | None = None,
        precision: str = "32",
        **group_options: Any,
    ):
        if not isinstance(static_graph, bool):
            raise TypeError(
                "static_graph: expected True (every step uses the same parameters, torch's DDP learns them in the "
                f"first) or False, got {static_graph!r}"
            )
        # the step marks ride in the first gradient bucket (_all_reduce_bucket)
        super().__init__(devices, IN_FIRST_BUCKET, precision=precision, **group_options)
        self.static_graph = static_graph
        if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
                                          or bucket_cap_mb <= 0):  # fmt: skip
            raise ValueError(
                f"bucket_cap_mb: expected a positive size in MiB (torch's default 25), got {bucket_cap_mb!r}"
            )
        self.bucket_cap_mb = bucket_cap_mb
        # a user's communication hook (torch's register_comm_hook(state, hook)), run in dpkit's slot
        self.user_hook: tuple[object, CommHook] | None = None
        if ddp_comm_hook is not None:
            state, hook = ddp_comm_hook if isinstance(ddp_comm_hook, tuple) else (None, ddp_comm_hook)
            self.register_comm_hook(state, hook)
        # the trainable parameters the reducer waits for, by name, and those that got a gradient this backward
        self._trainable: dict[str, nn.Parameter] = {}
        self._got_gradient: set[str] = set()
        # compress=: the exchange (its state: PowerSGD's) and the worker that runs it per bucket
        self.exchange: CompressedSum | None = None
        self.compressed: CompressedBuckets | None = None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.wrapped = nn.parallel.DistributedDataParallel(
            model,
            device_ids=device_ids,
            find_unused_parameters=self.group.options.find_unused_parameters,
            static_graph=self.static_graph,
            bucket_cap_mb=self.bucket_cap_mb,  # (None: torch's default, 25 MiB)
        )
        if not (self.group.options.find_unused_parameters or self.static_graph):
            self._watch_gradients(model)
        self.bucket_seconds: list[tuple[float, float]] = []  # (started, reduced) per bucket, while observed
        compression = self.group.options.compression
        if compression.compresses:  # the buckets cross compressed, exchanged by a worker thread
            names = {id(parameter): name for name, parameter in model.named_parameters()}
            self.exchange = CompressedSum(compression, seed=self.group.options.seed)
            self.compressed = CompressedBuckets(self.exchange, self.world_size, self.group.marks, names)
        # torch's own all-reduce hook (the same arithmetic as DDP's default), timed while anyone listens
        self.wrapped.register_comm_hook(None, self._all_reduce_bucket)
        return self.wrapped

    def _watch_gradients(self, model: nn.Module) -> None:
        """Note each trainable parameter that gets a gradient (the unused-parameter check in backward)."""
        self._trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self._got_gradient = set()
        for name, parameter in self._trainable.items():
            parameter.register_post_accumulate_grad_hook(lambda _, name=name: self._got_gradient.add(name))

    def _check_every_parameter_got_gradient(self) -> None:
        unused = [name for name in self._trainable if name not in self._got_gradient]
        if not unused:
            return
        shown = ", ".join(unused[: self.UNUSED_NAMES_SHOWN])
        more = f" and {len(unused) - self.UNUSED_NAMES_SHOWN} more" if len(unused) > self.UNUSED_NAMES_SHOWN else ""
        raise ValueError(
            f"find_unused_parameters: parameters {shown}{more} got no gradient this step (before the optimizer "
            "stepped, the weights are unchanged); pass find_unused_parameters=True, or freeze them "
            "(requires_grad_(False)) before engine.setup"
        )

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """A user's DDP communication hook (torch's `register_comm_hook(state, hook)`, e.g. fp16_compress_hook): DDP's
        one slot is dpkit's, which runs the user's hook for every bucket, recorded (its size: what the hook's own
        collectives put in) and with the step marks in an all-reduce of their own before the first bucket's."""
        if not callable(hook):
            raise TypeError(
                f"ddp_comm_hook: expected a hook(state, bucket) -> Future or a (state, hook) pair, got {hook!r}"
            )
        if self.group.options.compression.compresses:
            raise ValueError(
                f"ddp_comm_hook: the gradients already cross compressed (compress={self.group.options.compress!r}); "
                "give compress= or your own communication hook, not both"
            )
        self.user_hook = (state, hook)

    def _all_reduce_bucket(self, state, bucket):  # unannotated: torch checks annotations against its own classes
        if self.compressed is not None:
            return self.compressed.submit(bucket, timed=hooks.listening())
        buffer = bucket.buffer()
        if self.user_hook is not None:
            if self.group.marks.due_in_bucket(bucket.index()):
                self.group.marks.all_reduce_marks_alone()
            user_state, user_hook = self.user_hook
            with RECORD.issuing(f"all_reduce of gradient bucket {bucket.index()} (your comm hook)", None) as entry:
                reduced = user_hook(user_state, bucket)
        else:
            with RECORD.issuing(
                f"all_reduce of gradient bucket {bucket.index()}", buffer.numel() * buffer.element_size()
            ) as entry:
                if self.group.marks.due_in_bucket(bucket.index()):
                    reduced = self.group.marks.all_reduce_with_marks(buffer, entry)
                else:
                    reduced = allreduce_hook(state, bucket)
        if not hooks.listening():
            return reduced
        started = time.perf_counter()

        def finished(future: torch.futures.Future) -> torch.Tensor:
            # runs in the backend's thread when the bucket's all-reduce completed (host time: on CUDA an
            # approximation of when the collective finished on the stream)
            done = time.perf_counter()
            self.bucket_seconds.append((started, done))
            if entry is not None:
                entry.completed = done  # the record's entry gets its duration (dpkit profile --trace)
            return future.value()

        return reduced.then(finished)

    def announce_all_reduce(self) -> None:
        """Tell listeners the all-reduce time of the backward that just ended, and the part of it hidden
        behind backward's computation (which ends when the last bucket is ready, i.e. launched)."""
        timed = self.compressed.bucket_seconds if self.compressed is not None else getattr(self, "bucket_seconds", [])
        buckets = sorted(timed)
        timed.clear()
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
        forward = one_device_forward(
            self.wrapped.module if self.wrapped is not None else None, self.device, args, kwargs
        )
        if self.wrapped is None or self.next_backward_syncs():
            return forward
        # a micro-batch inside an accumulation window: DDP decides in forward whether its reducer waits for
        # gradients to all-reduce, so no_sync goes around the forward too (around backward alone it all-reduces
        # every micro-batch: the same sum, with the window's communication and compression work paid each time)
        stack = contextlib.ExitStack()
        stack.enter_context(self.wrapped.no_sync())
        stack.enter_context(forward)
        return stack

    def backward(self, loss: torch.Tensor, *, scale: float, sync: bool) -> None:
        # `scale` includes this process's loss weight (its rows * world / global rows, from the batch's record)
        skip_sync = self.wrapped.no_sync() if (not sync and self.wrapped is not None) else contextlib.nullcontext()
        if sync:
            RECORD.steps += 1
        self._got_gradient.clear()
        # a first bucket whose ranks' marks differ raises CollectiveMismatch, naming every rank's place; the
        # buckets' collectives get this call site (on a GPU the hook runs in autograd's thread)
        with (
            self.group.marks.checked_in_backward(),
            skip_sync,
            hooks.phase("backward", self.device),
            RECORD.pinned(),
            RECORD.exchanging_gradients(),
        ):
            (loss * scale if scale != 1.0 else loss).backward()  # waits for the last buckets' all-reduce
        if sync and self._trainable:
            # only the synchronizing backward counts: DDP's reducer waits on the parameters of that one
            self._check_every_parameter_got_gradient()
        if sync and self.exchange is not None:
            self.exchange.step_done()
        self.announce_all_reduce()

    # --- the compressed exchange's state (compressed_sum.py), this process's own ----------------------------
    def process_state(self) -> dict[str, Any] | None:
        return saved_exchange(self.exchange)

    def load_process_state(self, state: dict[str, Any]) -> str | None:
        return load_saved_exchange(self.exchange, state, self.device)

    def teardown(self) -> None:
        if self.compressed is not None:
            self.compressed.close()
            self.compressed = None
        super().teardown()
