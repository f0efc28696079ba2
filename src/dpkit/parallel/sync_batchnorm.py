"""nn.SyncBatchNorm across the replicas of one process: whole-batch statistics, forward and backward.

torch's SyncBatchNorm synchronises through torch.distributed, so between the threads of one process
(dpkit's `dp`, `dp-balanced` and `replicated`) it silently normalises each replica's chunk on its own.
Here the replicas of one step meet in each SyncBatchNorm layer instead:

- every replica computes its chunk's count, mean and sum of squared deviations per channel and leaves
  them at a per-step rendezvous (a StepGroup; layers are matched by the order replicas call them);
- once all have arrived, each replica combines all of them, in replica order, into the whole batch's
  mean and biased variance (Chan's parallel formula: no E[x²]-E[x]² cancellation), and normalises
  its chunk with them;
- the combination is an ordinary differentiable expression of every replica's local statistics, so
  autograd carries the cross-replica terms of the gradient itself: nothing waits for anyone in backward.
  The replicas' graphs are joined by it, so their backward must be one autograd pass (dp's is; under
  `replicated` the strategy runs one pass over all replicas' losses when a step was joined, since a
  per-thread backward of one replica would walk into the others' graphs);
- running statistics are updated once per step, with the whole-batch unbiased variance, on the buffers
  of the module the replicas were made from (the user's).

A replica that fails aborts the rendezvous: the others stop with PeerFailed and the runner reports the
failing replica's own error. A replica that ends its forward without reaching a layer another replica
waits in is an error that names both, never a hang.

Outside a step (the plain module, eval mode, replicas called by hand) a SyncBatchNorm runs torch's own
forward, which without torch.distributed is plain batch norm. Plain nn.BatchNorm layers are never
touched: they stay per-chunk, as in torch's DataParallel.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

from dpkit.parallel import hooks
from dpkit.parallel.apply import PeerFailed
from dpkit.parallel.concurrency import check_may_wait_for_peers

P = ParamSpec("P")
R = TypeVar("R")

_current = threading.local()  # .member: (StepGroup, index) of the replica job running in this thread


def has_sync_batchnorm(module: object) -> bool:
    return isinstance(module, nn.Module) and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules())


class _Stats:
    """One replica's contribution to one layer: rows counted per channel, mean, sum of squared deviations."""

    def __init__(self, count: int, mean: torch.Tensor, m2: torch.Tensor, name: str):
        self.count, self.mean, self.m2, self.name = count, mean, m2, name


class StepGroup:
    """The rendezvous of the replicas of one step: slot k holds what each replica left in its k-th
    SyncBatchNorm call."""

    def __init__(self, size: int):
        self.size = size
        self.condition = threading.Condition()
        self.slots: list[dict[int, _Stats]] = []
        self.calls = [0] * size  # SyncBatchNorm calls made so far, per replica
        self.finished = [False] * size  # the replica's job has returned
        self.failure: tuple[int, BaseException] | None = None
        self.joined = False  # some layer combined statistics of two or more replicas

    # --- membership ---------------------------------------------------------------------------------
    def wrap(self, job: Callable[P, R], index: int) -> Callable[P, R]:
        def as_member(*args: P.args, **kwargs: P.kwargs) -> R:
            previous = getattr(_current, "member", None)
            _current.member = (self, index)
            try:
                result = job(*args, **kwargs)
            except BaseException as error:
                self._fail(index, error)
                raise
            finally:
                _current.member = previous
            self._finish(index)
            return result

        return as_member

    def _fail(self, index: int, error: BaseException) -> None:
        with self.condition:
            if self.failure is None and not isinstance(error, PeerFailed):
                self.failure = (index, error)
            self.finished[index] = True
            self.condition.notify_all()

    def _finish(self, index: int) -> None:
        with self.condition:
            self.finished[index] = True
            self.condition.notify_all()

    # --- the exchange ---------------------------------------------------------------------------------
    def exchange(self, index: int, stats: _Stats) -> list[_Stats]:
        """Leave this replica's statistics for its next layer; return every replica's, in replica order."""
        with self.condition:
            call = self.calls[index]
            self.calls[index] += 1
            while len(self.slots) <= call:
                self.slots.append({})
            slot = self.slots[call]
            slot[index] = stats
            self.condition.notify_all()
            while len(slot) < self.size:
                if self.failure is not None:
                    failed, error = self.failure
                    raise PeerFailed(f"stopped: replica {failed} failed ({type(error).__name__}: {error})")
                gone = [i for i in range(self.size) if self.finished[i] and i not in slot]
                if gone:
                    raise RuntimeError(
                        f"SyncBatchNorm '{stats.name}': replica {index} waits in its SyncBatchNorm call {call + 1} for "
                        f"replica {gone[0]}, whose forward ended after {self.calls[gone[0]]} SyncBatchNorm calls; "
                        "every replica must call the same SyncBatchNorm layers in the same order"
                    )
                check_may_wait_for_peers(f"SyncBatchNorm '{stats.name}'")
                with hooks.peer_wait():
                    self.condition.wait()
            if len(slot) > 1:
                self.joined = True
            return [slot[i] for i in range(self.size)]


def synced_job(
    module: nn.Module, job: Callable[..., R], size: int, *, has_sync: bool | None = None
) -> tuple[Callable[..., R], StepGroup | None]:
    """`job` (called with the replica index first) as a member of a new step's rendezvous, or unchanged
    when `module` has no SyncBatchNorm in training mode. Returns the job and the group. `has_sync`: what
    has_sync_batchnorm(module) returns, when the caller knows (it walks every submodule)."""
    if size < 1 or not getattr(module, "training", False):
        return job, None
    if not (has_sync if has_sync is not None else has_sync_batchnorm(module)):
        return job, None
    group = StepGroup(size)

    def member_job(index: int, *args: Any, **kwargs: Any) -> R:
        return group.wrap(job, index)(index, *args, **kwargs)

    return member_job, group


def synced_replicas(
    module: nn.Module, replicas: Sequence[Callable[..., Any]], *, has_sync: bool | None = None
) -> Sequence[Callable[..., Any]]:
    """One callable per replica that joins this step's rendezvous (for parallel_apply); `replicas` itself (the
    same list) when `module` has no SyncBatchNorm in training mode. `has_sync`: what has_sync_batchnorm(module)
    returns, when the caller knows (it walks every submodule)."""
    if not replicas or not module.training:
        return replicas
    if not (has_sync if has_sync is not None else has_sync_batchnorm(module)):
        return replicas
    group = StepGroup(len(replicas))
    return [group.wrap(replica, i) for i, replica in enumerate(replicas)]


# --- the replicas' SyncBatchNorm ------------------------------------------------------------------------
def link_replica(original: nn.Module, replica: nn.Module, stats_owner: nn.Module | None = None) -> None:
    """Make `replica` (a SyncBatchNorm copy of `original`) synchronise inside a step; its running
    statistics go to `stats_owner` (default: `original`). Other modules are left alone."""
    if not isinstance(original, nn.SyncBatchNorm):
        return
    forward = types.MethodType(_replica_forward, replica)
    replica.__dict__["forward"] = forward
    replica.__dict__["_dpkit_stats_owner"] = original if stats_owner is None else stats_owner


def link_replicas(replicas: Sequence[nn.Module]) -> None:
    """Persistent replicas (strategy `replicated`): each one's SyncBatchNorm layers synchronise inside a
    step and keep running statistics on replica 0's layer (the user's module)."""
    if not replicas or not has_sync_batchnorm(replicas[0]):
        return
    firsts = list(replicas[0].modules())
    for replica in replicas:
        for first, mine in zip(firsts, replica.modules()):
            link_replica(first, mine, stats_owner=first)


def _replica_forward(self: nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
    member = getattr(_current, "member", None)
    if member is None or not self.training:
        # outside a step, or eval: torch's own forward (statistics of the chunk, or the running ones)
        return type(self).forward(self, input)
    group, index = member
    return _synced_batch_norm(self, input, group, index)


_replica_forward.__name__ = "forward"  # a pickled replica looks its forward up by this name


def _synced_batch_norm(layer: nn.SyncBatchNorm, x: torch.Tensor, group: StepGroup, index: int) -> torch.Tensor:
    layer._check_input_dim(x)
    layer._check_non_zero_input_channels(x)
    channels = x.shape[1]
    dims = [0] + list(range(2, x.dim()))
    count = x.numel() // channels if channels else 0
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # statistics in full precision
    if count:
        var, mean = torch.var_mean(work, dim=dims, correction=0)  # one pass over the chunk
        m2 = var * count
    else:  # no rows: contributes nothing, and stays out of the combination below
        mean = m2 = work.new_zeros(channels)
    name = type(layer).__name__ + f"(num_features={layer.num_features})"
    everyone = group.exchange(index, _Stats(count, mean, m2, name))
    for i, stats in enumerate(everyone):
        if stats.mean.shape != mean.shape:
            raise RuntimeError(
                f"SyncBatchNorm: replica {index} has {channels} channels where replica {i} has "
                f"{stats.mean.shape[0]} in the same call; replicas must run the same layers"
            )
    total = sum(s.count for s in everyone)
    if total <= 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {list(x.shape)} over the whole batch"
        )
    present = [s for s in everyone if s.count > 0]
    # replica order everywhere, so every replica computes bitwise the same statistics
    # (typeshed's sum() is int | Tensor, its start 0 when empty: `present` is not)
    batch_mean: torch.Tensor = sum(  # type: ignore[assignment]
        s.mean.to(work.device) * (s.count / total) for s in present
    )
    m2_total: torch.Tensor = sum(  # type: ignore[assignment]
        s.m2.to(work.device) + s.count * (s.mean.to(work.device) - batch_mean).square() for s in present
    )
    batch_var = m2_total / total
    if index == 0:
        _update_running_stats(layer, batch_mean.detach(), (m2_total / (total - 1)).detach())
    # per channel first, then one fused pass over the chunk: y = x * scale + shift, as torch's CPU kernel does
    scale = torch.rsqrt(batch_var + layer.eps)
    if layer.weight is not None:
        scale = scale * layer.weight
    shift = -batch_mean * scale if layer.bias is None else layer.bias - batch_mean * scale
    return torch.addcmul(_per_channel(shift, x.dim()), work, _per_channel(scale, x.dim())).to(x.dtype)


def _per_channel(values: torch.Tensor, ndim: int) -> torch.Tensor:
    return values.reshape([1, -1] + [1] * (ndim - 2))


def _update_running_stats(layer: nn.SyncBatchNorm, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
    """torch's BatchNorm update, once per step, on the owner's buffers (the user's module)."""
    owner = layer.__dict__.get("_dpkit_stats_owner", layer)
    if not (owner.track_running_stats and owner.running_mean is not None):
        return
    with torch.no_grad():
        factor = 0.0 if owner.momentum is None else owner.momentum
        if owner.num_batches_tracked is not None:
            owner.num_batches_tracked.add_(1)
            if owner.momentum is None:  # cumulative moving average
                factor = 1.0 / float(owner.num_batches_tracked)
        device = owner.running_mean.device
        owner.running_mean.mul_(1 - factor).add_(mean.to(device, owner.running_mean.dtype), alpha=factor)
        owner.running_var.mul_(1 - factor).add_(unbiased_var.to(device, owner.running_var.dtype), alpha=factor)
