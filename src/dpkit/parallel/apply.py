"""Run one job per replica, side by side in one persistent worker thread per device, or serially.

`run_replicas(devices, job)` is dpkit's one replica runner: DataParallel (through `parallel_apply`) and
the `replicated` strategy run every forward, loss, backward, gradient sum and optimizer step through it.
How a call site's jobs run is its declared `concurrency` (parallel/concurrency.py): "threads" (the default,
as torch's parallel_apply), "serial" (one after the other on the calling thread), or a Concurrency kept by
the call site, which may be "auto" (measured once, then frozen). Each job runs with

- the caller's grad mode, inference mode and autocast state (enabled, dtype, cache) re-entered;
- its device made current and the caller's stream on it (CUDA);
- on virtual CPU devices a fair share of torch's intra-op threads and, unless asked not to, its own
  torch.Generator seeded from the default CPU generator *in the calling thread*, so
  `torch.manual_seed` fixes dropout in every replica (threads would otherwise race on the one CPU
  generator); a caller that passes a RandomnessWatch gets it only while its jobs may draw;
- `dpkit.parallel.hooks.replica(i, device)` entered around it, for whoever observes.

Results come back in replica order after every job has finished. An error is re-raised in the caller
with its type, the replica index and the device in the message and the original chained.

KeyboardInterrupt and SystemExit are never held back: the caller waits in short slices, so Ctrl-C in
the main thread returns control within a fraction of a second even while a replica is stuck (the worker
threads, their lifetime and what happens to an abandoned job: parallel/workers.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.utils._pytree

from dpkit.devices import DeviceLike, cpu_threads_per_device, parse_device
from dpkit.parallel import hooks
from dpkit.parallel.concurrency import (
    AUTO,
    SERIAL,
    THREADS,
    Concurrency,
    check_concurrency,
    running_serially,
)
from dpkit.parallel.replica_rng import RandomnessWatch, ReplicaGenerator, replica_generators
from dpkit.parallel.streams import current_stream, device_context
from dpkit.parallel.workers import (
    Call,
    Job,
    abandon,
    hold_workers,
    passes_through,
    queue_jobs,
    stop_workers,
    wait_for_abandoned,
    worker_for,
)

__all__ = [  # the workers' names too, for callers that knew them here
    "CallerContext",
    "PeerFailed",
    "hold_workers",
    "parallel_apply",
    "resolve_concurrency",
    "run_replicas",
    "stop_workers",
    "worker_for",
]

T = TypeVar("T")


class PeerFailed(RuntimeError):
    """Raised inside a replica's job that stops because another replica failed; the runner reports the
    other replica's error, not this one."""


@dataclass(frozen=True)
class CallerContext:
    """The thread-local autograd and autocast state of the caller, to re-enter in worker threads."""

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, torch.dtype], ...]
    autocast_cache: bool

    @classmethod
    def capture(cls) -> CallerContext:
        autocast = tuple(
            (device_type, torch.get_autocast_dtype(device_type))
            for device_type in ("cpu", "cuda")
            if torch.is_autocast_enabled(device_type)
        )
        return cls(
            torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, torch.is_autocast_cache_enabled()
        )

    def enter(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.inference_mode:
            stack.enter_context(torch.inference_mode())
        else:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        for device_type, dtype in self.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=self.autocast_cache))
        return stack


def _rethrow(index: int, device: torch.device, error: BaseException) -> None:
    message = f"in replica {index} on device {device}: {type(error).__name__}: {error}"
    try:
        wrapped = type(error)(message)
    except Exception:  # exception types whose constructor takes other arguments
        wrapped = RuntimeError(message)
    raise wrapped from error


def _run_job(
    job: Callable[[int], T],
    index: int,
    device: torch.device,
    context: CallerContext,
    stream: torch.cuda.Stream | None,
    mode: ReplicaGenerator | None,
    threads: int | None,
) -> T:
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)  # per thread under OpenMP: the worker's own (serially: restored after)
    with contextlib.ExitStack() as stack:
        stack.enter_context(device_context(device, stream))
        stack.enter_context(context.enter())
        if mode is not None:
            stack.enter_context(mode)
        stack.enter_context(hooks.replica(index, device))
        return job(index)


def resolve_concurrency(concurrency: str | Concurrency, argument: str = "concurrency") -> Concurrency | str:
    """A call's `concurrency`: a call site's Concurrency as it is, or 'threads' / 'serial' for this one call.
    'auto' needs a Concurrency kept between calls (it measures across them)."""
    if isinstance(concurrency, Concurrency):
        return concurrency
    if check_concurrency(concurrency, argument) == AUTO:
        raise ValueError(
            f"{argument}: 'auto' measures across calls, so it needs a policy the call site keeps: pass "
            "dpkit.parallel.concurrency.Concurrency('auto') (made once) in every call, or 'threads' or 'serial'"
        )
    return concurrency


def run_replicas(
    devices: Sequence[torch.device],
    job: Callable[[int], T],
    *,
    generators: bool | RandomnessWatch = True,
    threads: int | None = None,
    on_interrupt: Callable[[], None] | None = None,
    concurrency: str | Concurrency = THREADS,
) -> list[T]:
    """[job(0), …, job(n-1)], job(i) run for devices[i]: in its worker thread, or serially on this thread.

    Args:
        devices: one torch.device per replica, no two the same (each device has one worker thread).
        job: called with the replica index; whatever it returns is that replica's result.
        generators: give each replica on a virtual CPU device its own seeded generator for random
            operators (dropout). Jobs that draw no random numbers (backward, optimizer steps) pass False:
            it saves drawing seeds and the per-operator dispatch. A RandomnessWatch gives the generators
            while the call site's jobs may draw, and learns from each run whether they do.
        threads: intra-op threads per replica on virtual CPU devices (default: the cores shared evenly).
        on_interrupt: called when the caller stops waiting (KeyboardInterrupt, SystemExit), before those
            jobs that have not started are dropped: jobs that wait for each other use it to give up.
        concurrency: "threads" (side by side, the default), "serial" (one after the other on this thread),
            or the call site's Concurrency (declared, or auto: this call runs its next way and is measured).

    With one device the job runs in the calling thread (nothing to run beside it).
    """
    policy = resolve_concurrency(concurrency)
    devices = list(devices)
    context = CallerContext.capture()
    streams = [current_stream(device) for device in devices]
    n = len(devices)
    if n == 1:
        try:
            return [_run_job(job, 0, devices[0], context, streams[0], None, None)]
        except Exception as error:
            _rethrow(0, devices[0], error)
    if len({str(d) for d in devices}) != n:
        raise ValueError(
            f"devices: {[str(d) for d in devices]} names a device twice; each replica needs its own device"
        )
    on_cpu = all(device.type == "cpu" for device in devices)
    watch = generators if on_cpu and isinstance(generators, RandomnessWatch) else None
    state_before = None
    modes: list[ReplicaGenerator | None]
    if watch is not None:
        modes, state_before = watch.begin(n)
    else:
        modes = [*replica_generators(n)] if on_cpu and generators else [None] * n
    if on_cpu and threads is None:
        threads = cpu_threads_per_device(n)
    elif not on_cpu:
        threads = None
    wait_for_abandoned(devices)
    way = policy.way() if isinstance(policy, Concurrency) else policy
    began = time.perf_counter()
    if way == SERIAL:
        results = _run_serially(devices, job, context, streams, modes, threads, on_interrupt)
    else:
        results = _run_in_threads(devices, job, context, streams, modes, threads, on_interrupt)
    if isinstance(policy, Concurrency):
        policy.ran(way, time.perf_counter() - began, jobs=n)
    if watch is not None:
        watch.end(modes, state_before)
    return results


def _run_in_threads(
    devices: list[torch.device],
    job: Callable[[int], T],
    context: CallerContext,
    streams: Sequence[torch.cuda.Stream | None],
    modes: Sequence[ReplicaGenerator | None],
    threads: int | None,
    on_interrupt: Callable[[], None] | None,
) -> list[T]:
    """Every job in its device's worker thread, side by side; the caller waits, interruptibly."""
    # the caller's intra-op thread count, read before any worker sets its share: torch gives a thread that never
    # asked the last count any thread set, which would leave the caller at a device's share for good
    torch.get_num_threads()
    call = Call(len(devices))
    jobs: list[Job[T]] = [
        Job(_run_job, (job, i, device, context, stream, mode, threads), call)
        for i, (device, stream, mode) in enumerate(zip(devices, streams, modes))
    ]
    try:
        with hooks.handing_off(devices):
            queue_jobs(devices, jobs)
            call.wait()
        for queued in jobs:
            if queued.error is not None and passes_through(queued.error):
                raise queued.error
    except BaseException:
        if on_interrupt is not None:
            on_interrupt()
        abandon(devices, jobs)
        raise
    failures = [(i, queued.error) for i, queued in enumerate(jobs) if queued.error is not None]
    if failures:
        first = next(((i, e) for i, e in failures if not isinstance(e, PeerFailed)), failures[0])
        _rethrow(first[0], devices[first[0]], first[1])
    return [queued.result() for queued in jobs]  # (every job ran without error: its value)


def _run_serially(
    devices: list[torch.device],
    job: Callable[[int], T],
    context: CallerContext,
    streams: Sequence[torch.cuda.Stream | None],
    modes: Sequence[ReplicaGenerator | None],
    threads: int | None,
    on_interrupt: Callable[[], None] | None,
) -> list[T]:
    """Every job one after the other on the calling thread, each in its device's context, intra-op threads and
    generator as in its worker thread, so the results are the same, without handing each job to a thread and
    waking the caller afterwards. The first failure that is not a PeerFailed is reported; the others run on."""
    own_threads = torch.get_num_threads()
    results: list[T] = []
    failure: tuple[int, torch.device, BaseException] | None = None
    try:
        with running_serially():
            for i, (device, stream, mode) in enumerate(zip(devices, streams, modes)):
                try:
                    results.append(_run_job(job, i, device, context, stream, mode, threads))
                except Exception as error:  # (the results are dropped: a failure is raised below)
                    if failure is None or isinstance(failure[2], PeerFailed):
                        failure = (i, device, error)
    except BaseException:
        if on_interrupt is not None:
            on_interrupt()
        raise
    finally:
        if torch.get_num_threads() != own_threads:
            torch.set_num_threads(own_threads)
    if failure is not None:
        _rethrow(*failure)
    return results


def _as_device_list(devices: Sequence[DeviceLike] | None, inputs: Sequence[Any], n: int) -> list[torch.device]:
    if devices is not None:
        if isinstance(devices, (str, bytes)) or not hasattr(devices, "__len__"):
            raise TypeError(
                f"devices: expected a list of devices (ints, 'cuda:1', 'cpu:3', torch.device), got {devices!r}"
            )
        if len(devices) != n:
            raise ValueError(f"devices: has {len(devices)} entries for {n} modules; give one device per module")
        return [parse_device(d, argument=f"devices[{i}]") for i, d in enumerate(devices)]
    # as torch: the device of the first tensor in each input; CPU inputs get the virtual devices cpu:0..n-1
    found = []
    for i, item in enumerate(inputs):
        tensor = next((t for t in torch.utils._pytree.tree_leaves(item) if isinstance(t, torch.Tensor)), None)
        found.append(tensor.device if tensor is not None and tensor.device.type != "cpu" else torch.device("cpu", i))
    return found


def parallel_apply(
    modules: Sequence[Callable],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict] | None = None,
    devices: Sequence[DeviceLike] | None = None,
    *,
    generators: bool | RandomnessWatch = True,
    concurrency: str | Concurrency = THREADS,
) -> list[Any]:
    """torch.nn.parallel.parallel_apply on dpkit's runner: modules[i](*inputs[i], **kwargs_tup[i]) on devices[i].

        As in torch, an input that is a tuple or a list is the argument list and anything else (a bare tensor)
        is one argument. Devices accept dpkit's specs: ints (CUDA indices), "cuda:1", "cpu:3", torch.device;
        without devices, each module runs on its input's device (CPU inputs on cpu:0, cpu:1, …). Outputs come
        in module order; an error names the replica and device. `generators`, `concurrency` (default "threads",
    as torch; "serial", or a Concurrency the caller keeps, which may be auto) are run_replicas'.
    """
    n = len(modules)
    if len(inputs) != n:
        raise ValueError(f"inputs: has {len(inputs)} entries for {n} modules; give one input per module")
    if kwargs_tup is None:
        kwargs_tup = ({},) * n
    elif len(kwargs_tup) != n:
        raise ValueError(f"kwargs_tup: has {len(kwargs_tup)} entries for {n} modules; give one dict per module")
    device_list = _as_device_list(devices, inputs, n)
    arguments = [tuple(item) if isinstance(item, (list, tuple)) else (item,) for item in inputs]

    def job(i: int) -> Any:
        return modules[i](*arguments[i], **(kwargs_tup[i] or {}))

    return run_replicas(device_list, job, generators=generators, concurrency=concurrency)
