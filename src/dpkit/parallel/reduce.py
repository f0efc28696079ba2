"""The gradient sum among replicas in one process: afterwards every replica's .grad holds the sum.

Replicas that apply the same summed gradient with the same optimizer stay equal, so this is the
exchange that DDP's all-reduce does between processes, done here between threads.

Parameters are grouped into buckets in reverse registration order (the order backward produces their
gradients), each up to `bucket_cap_bytes`, as DDP's reducer does.

On virtual CPU devices `backward(...)` runs every replica's backward in its own worker thread, or, where the
gradient sum's `concurrency` says serial, one after the other on the calling thread and then the sum. With
several buckets, a post-accumulate-grad hook on each replica's parameters marks its bucket; a bucket whose
gradients are final in every replica is queued, cut in one share per thread (runs of about equal numbers
of elements: small parameters whole, large ones in pieces). A replica thread that has finished its own
backward sums queued shares while the others are still in theirs, then every thread helps with what is
left. So the sum fills time that would otherwise be idle (replicas with fewer rows, or with nothing to
do), and never delays a backward on the cores a busy replica uses. With one bucket nothing can overlap:
no hooks (a Python call per parameter in every backward), the shares are queued when the backwards end.
A share is summed in a few foreach calls, not one call per parameter, which for a model of many small
layers costs more Python than the arithmetic. Each element is summed in replica order (0 + 1 + …),
whatever thread sums it, so the result is bitwise the same with or without buckets.

On GPUs torch's own CUDA collectives (torch.cuda.comm, NCCL where available) sum each bucket onto the
first device and broadcast it back, after the backward, which the autograd engine has already run on
every GPU side by side.

A parameter that has a gradient in some replicas but not in others gets zeros in the others first (its
sum is the others' sum); one that has none anywhere keeps None.

After an all-reduce every replica holds the sum; `release_copies()`, called before the next backward,
drops the other replicas' copies again (replica 0 keeps the sum), so a second backward before zero_grad()
adds only its new gradient and the next sum counts the first one once, as one device would.

With `everywhere=False` the sum is a reduce rather than an all-reduce: only replica 0's .grad receives it,
and the other replicas' gradients are released (None) afterwards, so a later backward before the next
zero_grad() adds only new gradient there and the next sum counts nothing twice. The replicated strategy
uses it on virtual CPU devices, where every replica's parameters share replica 0's storage and one
optimizer step updates them all.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch.utils.hooks import RemovableHandle

from dpkit.checks import check_int
from dpkit.parallel import hooks
from dpkit.parallel.apply import PeerFailed, run_replicas
from dpkit.parallel.concurrency import AUTO, SERIAL, THREADS, Concurrency

DEFAULT_BUCKET_CAP_BYTES = 4 * 1024 * 1024
# a sum made another way (the replicated strategy's compressed exchange): (the positions of the parameters that
# have a gradient, grads[replica][k] of position k) -> the sum of each
Exchange = Callable[[list[int], list[list[torch.Tensor]]], list[torch.Tensor]]


def plan_buckets(params: Sequence[torch.Tensor], bucket_cap_bytes: int) -> list[list[int]]:
    """Parameter positions grouped in reverse order, each group up to bucket_cap_bytes (at least one)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size_bytes = 0
    for position in reversed(range(len(params))):
        nbytes = params[position].numel() * params[position].element_size()
        if current and size_bytes + nbytes > bucket_cap_bytes:
            buckets.append(current)
            current, size_bytes = [], 0
        current.append(position)
        size_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets


def fill_missing_grads(group: Sequence[torch.Tensor]) -> bool:
    """Zeros where a replica lacks a gradient that another has; False when none has one."""
    present = [p.grad is not None for p in group]
    if not any(present):
        return False
    if not all(present):
        for p in group:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    return True


def _gradients(group: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Every replica's gradient of one parameter; None when replica 0 has none (nothing to sum)."""
    grads = [p.grad for p in group]
    if grads[0] is None:
        return None
    present = [g for g in grads if g is not None]
    if len(present) != len(grads):
        raise RuntimeError("gradient sum: a replica has no gradient for a parameter whose replica 0 has one")
    return present


def sum_slice(group: Sequence[torch.Tensor], k: int, slices: int, everywhere: bool = True) -> None:
    """Slice k (of `slices`) of one parameter's gradient, summed over replicas in replica order into
    replica 0's and, with `everywhere`, written back to every replica (GradientSum(coalesce=False))."""
    grads = _gradients(group)
    if grads is None:
        return
    receivers = grads if everywhere else grads[:1]
    with torch.no_grad():
        if not all(g.is_contiguous() for g in grads):  # rare layouts: whole tensors, by slice 0
            if k == 0:
                total = grads[0].clone()
                for g in grads[1:]:
                    total.add_(g.to(total.device))
                for g in receivers:
                    g.copy_(total)
            return
        numel = grads[0].numel()
        lo, hi = numel * k // slices, numel * (k + 1) // slices
        if lo == hi:
            return
        parts = [g.view(-1)[lo:hi] for g in grads]
        total = parts[0]  # replica 0's slice becomes the sum in place
        for part in parts[1:]:
            total.add_(part)
        if everywhere:
            for part in parts[1:]:
                part.copy_(total)


# a share of one bucket's sum: (parameter position, first element, end element) segments
Share = list[tuple[int, int, int]]


def plan_shares(params: Sequence[torch.Tensor], bucket: Sequence[int], shares: int) -> list[Share]:
    """The bucket's elements cut into `shares` runs of about equal size, in bucket order: small parameters
    whole, a parameter that crosses a boundary in pieces. Each thread sums one share in a few foreach calls,
    where one call per parameter and slice would cost more Python than a small parameter's sum itself."""
    sizes = [(position, params[position].numel()) for position in bucket]
    total = sum(n for _, n in sizes)
    out: list[Share] = [[] for _ in range(shares)]
    start = 0  # the bucket's running element count
    for position, numel in sizes:
        lo = 0
        while lo < numel:
            k = min(shares - 1, (start + lo) * shares // total) if total else 0
            end_of_share = (k + 1) * total // shares
            hi = numel if k == shares - 1 else min(numel, end_of_share - start)
            hi = max(hi, lo + 1)
            out[k].append((position, lo, hi))
            lo = hi
        start += numel
    return out


def sum_share(groups: Sequence[Sequence[torch.Tensor]], share: Share, everywhere: bool = True) -> None:
    """One share of a bucket, summed over replicas in replica order (0 + 1 + …) into replica 0's gradients
    and, with `everywhere`, written back to every replica's: bitwise what summing each element alone gives."""
    columns: list[list[torch.Tensor]] = []
    for position, lo, hi in share:
        grads = _gradients(groups[position])
        if grads is None:
            continue
        if lo == 0 and hi == grads[0].numel():
            columns.append(grads)
        elif all(g.is_contiguous() for g in grads):
            columns.append([g.view(-1)[lo:hi] for g in grads])
        elif lo == 0:  # a rare layout: the whole tensor, by the share that holds its first element
            columns.append(grads)
    if not columns:
        return
    per_replica = [list(column) for column in zip(*columns)]
    with torch.no_grad():
        if any(g.is_sparse for g in per_replica[0]):  # sparse gradients: one parameter at a time
            for column in columns:
                total = column[0]
                for g in column[1:]:
                    total.add_(g.to(total.device))
                for g in column[1:] if everywhere else ():
                    g.copy_(total)
            return
        totals = per_replica[0]
        for other in per_replica[1:]:
            torch._foreach_add_(totals, other)
        for other in per_replica[1:] if everywhere else ():
            torch._foreach_copy_(other, totals)


class _Round:
    """One overlapped backward-and-sum on CPU: which buckets are final, and the slices left to sum."""

    def __init__(self, gradient_sum: GradientSum, active: Sequence[int]):
        self.gradient_sum = gradient_sum
        self.condition = threading.Condition()
        trainable = [p.requires_grad for p in gradient_sum.params[0]]  # frozen ones never fire a hook
        self.pending_hooks = [
            sum(trainable[position] for position in bucket) * len(active) if gradient_sum.hooked else -1
            for bucket in gradient_sum.buckets
        ]
        self.queued = [False] * len(gradient_sum.buckets)
        self.work: collections.deque = collections.deque()
        self.backwards_left = len(active)
        self.failed = False

    def grad_ready(self, bucket: int) -> None:
        with self.condition:
            self.pending_hooks[bucket] -= 1
            if self.pending_hooks[bucket] == 0:
                self._queue(bucket)
                self.condition.notify_all()

    def _queue(self, bucket: int) -> None:  # under the lock
        if self.queued[bucket]:
            return
        self.queued[bucket] = True
        gradient_sum = self.gradient_sum
        groups, slices = gradient_sum.groups, len(gradient_sum.devices)
        for position in gradient_sum.buckets[bucket]:
            if fill_missing_grads(groups[position]) and not gradient_sum.coalesce:
                self.work.extend((groups[position], k, slices) for k in range(slices))
        if gradient_sum.coalesce:
            self.work.extend(share for share in gradient_sum.shares[bucket] if share)

    def backward_done(self) -> None:
        with self.condition:
            self.backwards_left -= 1
            if self.backwards_left == 0:  # gradients nobody produced this time are final as they are
                for bucket in range(len(self.queued)):
                    self._queue(bucket)
            self.condition.notify_all()

    def abort(self) -> None:
        with self.condition:
            self.failed = True
            self.condition.notify_all()

    def help_sum(self) -> None:
        """Sum queued slices until every bucket is queued and the queue is empty."""
        while True:
            with self.condition:
                while not self.work and self.backwards_left > 0 and not self.failed:
                    with hooks.peer_wait():
                        self.condition.wait()
                if self.failed:
                    raise PeerFailed("stopped: another replica failed during backward")
                if not self.work:
                    return
                item = self.work.popleft()
            if self.gradient_sum.coalesce:
                sum_share(self.gradient_sum.groups, item, self.gradient_sum.everywhere)
            else:
                group, k, slices = item
                sum_slice(group, k, slices, everywhere=self.gradient_sum.everywhere)


class GradientSum:
    """The gradient sum of n replicas whose parameters correspond position by position.

    Args:
        params: params[i] is replica i's parameter list; all replicas list them in the same order.
        devices: devices[i] is replica i's device.
        bucket_cap_bytes: the largest bucket (a parameter larger than it is a bucket of its own).
        overlap: on virtual CPU devices, sum buckets while other replicas are still in backward
            (False: backward everywhere first, then the sum; kept for measuring the difference).
        threads: intra-op threads per replica thread on virtual CPU devices (default: a fair share).
        everywhere: every replica's .grad receives the sum (an all-reduce); False: only replica 0's, and the
            others' gradients are released after each sum (a reduce; virtual CPU devices only).
        coalesce: on virtual CPU devices, sum each bucket in one share per thread, a few foreach calls each, and
            hook the parameters only when there are several buckets to overlap; False: one slice of each
            parameter per thread and a hook on every parameter, as before (kept for measuring the difference).
        concurrency: how the replicas' backwards run on virtual CPU devices with coalesce: "threads" (side by
            side, the sum overlapped), "serial" (one after the other on the calling thread, then the sum; for
            models of many small operators, whose backwards gain nothing from running side by side on the cores
            and lose the hand-offs), "auto" (measured once, backward and sum together, then frozen), or a
            Concurrency to share. The sum is bitwise the same either way. `self.concurrency.choice()` is what a
            run records. Without coalesce, or on GPUs, always threads.
    """

    def __init__(
        self,
        params: Sequence[Sequence[torch.Tensor]],
        devices: Sequence[torch.device],
        *,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
        overlap: bool = True,
        threads: int | None = None,
        everywhere: bool = True,
        coalesce: bool = True,
        concurrency: str | Concurrency = AUTO,
        exchange: Exchange | None = None,
    ):
        if len(params) != len(devices):
            raise ValueError(
                f"params: has {len(params)} replicas' lists for {len(devices)} devices; give one list per device"
            )
        counts = {len(p) for p in params}
        if len(counts) > 1:
            raise ValueError(
                f"params: replicas have different parameter counts {sorted(counts)}; "
                "replicas must have the same parameters"
            )
        check_int(bucket_cap_bytes, "bucket_cap_bytes", meaning="bytes per bucket")
        self.devices = list(devices)
        self.params = [list(p) for p in params]
        self.groups = list(zip(*self.params))  # groups[position]: that parameter in every replica
        self.on_cpu = all(d.type == "cpu" for d in self.devices)
        if not everywhere and not self.on_cpu:
            raise ValueError(
                "everywhere: False (a reduce into replica 0) is only for virtual CPU devices, "
                "whose replicas share memory"
            )
        self.everywhere = everywhere
        self.coalesce = coalesce
        # a compressed exchange replaces the plain sum (after every backward: nothing overlaps it)
        self.exchange = exchange
        self.overlap = overlap and exchange is None
        self.threads = threads
        self.buckets = plan_buckets(self.params[0], bucket_cap_bytes) if self.params else []
        # each bucket in one share per thread (virtual CPU devices)
        self.shares = [plan_shares(self.params[0], bucket, len(self.devices)) for bucket in self.buckets]
        self._thread = threading.local()  # .round: the round the backward in this thread belongs to
        self._holding_copies = False  # replicas other than 0 hold the last sum (after an all-reduce)
        self._handles: list[RemovableHandle] = []
        # the replicas' backwards one after the other, or side by side with the sum overlapped
        if not isinstance(concurrency, Concurrency):
            concurrency = Concurrency(concurrency)
        self.concurrency = concurrency if self.on_cpu and len(self.devices) > 1 and coalesce else Concurrency(THREADS)
        # a bucket can be summed while backwards still run only if there is another one after it: with one
        # bucket the sum starts when the backwards end, and a hook per parameter would only cost Python work
        self.hooked = self.on_cpu and len(self.devices) > 1 and overlap and (len(self.buckets) > 1 or not coalesce)
        if self.hooked:
            bucket_of = {position: b for b, bucket in enumerate(self.buckets) for position in bucket}
            for replica_params in self.params:
                for position, p in enumerate(replica_params):
                    if p.requires_grad:
                        self._handles.append(p.register_post_accumulate_grad_hook(self._hook(bucket_of[position])))

    def _hook(self, bucket: int):
        def grad_ready(_: torch.Tensor) -> None:
            # hooks fire in the thread running the replica's backward: only backward(..., sync=True) has a
            # round there; other backwards (accumulating, or on the caller's thread) are summed later
            round_ = getattr(self._thread, "round", None)
            if round_ is not None:
                round_.grad_ready(bucket)

        return grad_ready

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # --- after backward ------------------------------------------------------------------------------
    def sum_now(self) -> None:
        """Replica 0's gradient becomes the sum over replicas, and every replica's with `everywhere`
        (gradients already computed)."""
        if len(self.devices) < 2 or not self.groups:
            return
        if self.exchange is not None:
            self._exchange_now(self.exchange)
            return
        if not self.on_cpu:
            with hooks.phase("all_reduce", self.devices[0]):
                self._sum_cuda()
            self._holding_copies = True
            return
        for group in self.groups:
            fill_missing_grads(group)

        def job(k: int) -> None:
            with hooks.replica_phase("all_reduce"):
                if not self.coalesce:
                    for group in self.groups:
                        sum_slice(group, k, len(self.devices), self.everywhere)
                    return
                for shares in self.shares:
                    sum_share(self.groups, shares[k], self.everywhere)

        run_replicas(self.devices, job, generators=False, threads=self.threads)
        self._release_others()

    def _exchange_now(self, exchange: Exchange) -> None:
        """The sum as `exchange` makes it (a compressed one): given the positions of the parameters that have a
        gradient and every replica's gradients of them, it returns their sums, which replica 0 receives (and every
        replica with `everywhere`)."""
        for group in self.groups:
            fill_missing_grads(group)
        positions = [position for position, group in enumerate(self.groups) if group[0].grad is not None]
        with hooks.phase("all_reduce", self.devices[0]), torch.no_grad():
            # (filled above: every replica has a gradient of each of these positions)
            grads = [[cast(torch.Tensor, replica_params[p].grad) for p in positions] for replica_params in self.params]
            sums = exchange(positions, grads)
            for position, total in zip(positions, sums):
                group = self.groups[position]
                for p in group if self.everywhere else group[:1]:
                    cast(torch.Tensor, p.grad).copy_(total.to(p.device))
        if self.on_cpu:
            self._release_others()
        else:
            self._holding_copies = True

    def _release_others(self) -> None:
        """After a reduce into replica 0 the other replicas start their next gradient from nothing; after an
        all-reduce they keep the sum (their optimizers step with it) until release_copies()."""
        if self.everywhere:
            self._holding_copies = True
        else:
            self._drop_other_gradients()

    def release_copies(self) -> None:
        """Before a backward: drop the sum the other replicas received from the last all-reduce, if no
        zero_grad() came between (replica 0 keeps it), so the next sum does not count it once per replica."""
        if self._holding_copies:
            self._drop_other_gradients()
            self._holding_copies = False

    def _drop_other_gradients(self) -> None:
        for replica_params in self.params[1:]:
            for p in replica_params:
                p.grad = None

    def _sum_cuda(self) -> None:
        from torch.cuda import comm

        with torch.no_grad():
            for bucket in self.buckets:
                groups = [self.groups[position] for position in bucket if fill_missing_grads(self.groups[position])]
                if not groups:
                    continue
                per_device = [[p.grad for p in replica_params] for replica_params in zip(*groups)]
                summed = comm.reduce_add_coalesced(per_device, destination=self.devices[0].index)
                copies = comm.broadcast_coalesced(summed, [d.index for d in self.devices])
                for grads, new in zip(per_device, copies):
                    for g, value in zip(grads, new):
                        g.copy_(value)

    # --- backward, then or while summing ---------------------------------------------------------------
    def backward(self, roots: Sequence[tuple[int, torch.Tensor, torch.Tensor]], *, sync: bool) -> None:
        """Run the backward of every (replica index, loss, grad_output) and, with sync, the sum.

        On virtual CPU devices each replica's backward runs in its worker thread, which also frees that
        replica's graph: a list of roots is emptied, so pass the only reference; with sync and more than
        one device, buckets are summed as they become final (see the module doc). On GPUs one autograd
        call runs them all (torch's engine runs each GPU's part in its own thread).
        """
        self.release_copies()
        if not self.on_cpu:
            torch.autograd.backward([loss for _, loss, _ in roots], [grad for _, _, grad in roots])
            if sync:
                self.sum_now()
            return
        # the roots leave the caller's list: each replica's thread then holds the last reference to its loss,
        # so its graph (every node of its forward) is freed there, side by side, not on the calling thread
        pending = roots if isinstance(roots, list) else list(roots)
        by_replica: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        while pending:
            root = pending.pop()
            by_replica[root[0]] = root[1:]
            del root
        active = sorted(by_replica)

        def run_backward(i: int) -> None:
            loss, grad = by_replica.pop(i)
            with hooks.replica_phase("backward"):
                torch.autograd.backward(loss, grad)
                del loss, grad  # the graph goes here, in this replica's thread

        if len(active) < 2:
            self._side_by_side(active, by_replica, run_backward, sync)
            return
        way = self.concurrency.way()
        began = time.perf_counter()
        if way == SERIAL:  # one after the other on the calling thread, then the sum
            run_replicas(
                [self.devices[i] for i in active],
                lambda k: run_backward(active[k]),
                generators=False,
                threads=self.threads,
                concurrency=SERIAL,
            )
            if sync:
                self.sum_now()
        else:
            self._side_by_side(active, by_replica, run_backward, sync)
        # the way measured whole, backward and sum; its jobs: the replicas' backwards
        self.concurrency.ran(way, time.perf_counter() - began, jobs=len(active))

    def _side_by_side(
        self,
        active: list[int],
        by_replica: dict[int, tuple[torch.Tensor, torch.Tensor]],
        run_backward: Callable[[int], None],
        sync: bool,
    ) -> None:
        """The replicas' backwards side by side, each in its worker thread, and with sync the sum: overlapped
        with them where buckets allow (see the module doc)."""
        if not (sync and self.overlap and len(self.devices) > 1 and self.groups):
            run_replicas(
                [self.devices[i] for i in active],
                lambda k: run_backward(active[k]),
                generators=False,
                threads=self.threads,
            )
            if sync:
                self.sum_now()
            return
        round_ = _Round(self, active)

        def backward_then_sum(i: int) -> None:
            self._thread.round = round_
            try:
                if i in by_replica:
                    run_backward(i)
                    round_.backward_done()
                with hooks.replica_phase("all_reduce"):
                    round_.help_sum()
            except BaseException:
                round_.abort()
                raise
            finally:
                self._thread.round = None

        # on Ctrl-C the round is aborted, so replicas waiting for one that never starts give up
        run_replicas(self.devices, backward_then_sum, generators=False, threads=self.threads, on_interrupt=round_.abort)
        self._release_others()
