"""Run one job per replica side by side, one persistent worker thread per device.

`run_replicas(devices, job)` is dpkit's one replica runner: DataParallel (through `parallel_apply`) and
the `replicated` strategy run every forward, loss, backward, gradient sum and optimizer step through it.
Each job runs in its device's worker thread with

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
the main thread returns control within a fraction of a second even while a replica is stuck. Python
cannot stop a running thread, so the jobs of an interrupted call run on. The next call that needs a
worker still busy with such an abandoned job waits for it (still interruptible) for up to
ABANDONED_WAIT_SECONDS and then raises a RuntimeError naming the device, rather than starting a second
thread on a replica whose tensors the old job may still be writing, or hanging silently.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree

from dpkit.devices import DeviceLike, cpu_threads_per_device, parse_device
from dpkit.parallel import hooks
from dpkit.parallel.replica_rng import RandomnessWatch, ReplicaGenerator, replica_generators
from dpkit.parallel.streams import current_stream, device_context

# how long the caller sleeps between checks for Ctrl-C while it waits for replicas
WAIT_SLICE_SECONDS = 0.05
# how long a call waits for a worker still running a job of an earlier, interrupted call
ABANDONED_WAIT_SECONDS = 10.0
# how long a job that takes turns waits for its turn before it runs anyway (see Turns)
TURN_TIMEOUT_SECONDS = 0.02


class PeerFailed(RuntimeError):
    """Raised inside a replica's job that stops because another replica failed; the runner reports the
    other replica's error, not this one."""


class _Call:
    """One run_replicas call: counts its jobs down and opens `finished` (a lock held until then) when the
    last one ends, or at once when one raises what passes through (KeyboardInterrupt, SystemExit)."""

    __slots__ = ("left", "lock", "finished", "open")

    def __init__(self, jobs: int):
        self.left = jobs
        self.lock = threading.Lock()
        self.finished = threading.Lock()
        self.finished.acquire()
        self.open = False

    def job_ended(self, error: BaseException | None) -> None:
        with self.lock:
            self.left -= 1
            if (self.left == 0 or _passes_through(error)) and not self.open:
                self.open = True
                self.finished.release()

    def wait(self) -> None:
        """Until finished; in slices, so a signal in the caller is handled within one."""
        while not self.finished.acquire(timeout=WAIT_SLICE_SECONDS):
            pass


class Job:
    """A function queued on a device's worker thread: what concurrent.futures.Future offers that dpkit uses
    (result, done, cancel), without a condition variable per job."""

    __slots__ = ("fn", "args", "call", "state", "value", "error", "_done")

    def __init__(self, fn: Callable, args: tuple, call: _Call | None = None):
        self.fn: Callable | None = fn  # None once it ran: the job keeps no reference to its work
        self.args: tuple | None = args
        self.call = call
        self.state = "queued"  # -> "running" -> "done", or "cancelled" before it runs
        self.value: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event() if call is None else None  # a lone job's result() waits on it

    def run(self) -> None:
        if self.state != "queued":
            return
        self.state = "running"
        fn, args = self.fn, self.args
        try:
            if fn is None or args is None:  # (set until it runs, and it runs once)
                raise RuntimeError("a replica job ran twice")
            self.value = fn(*args)
        except BaseException as error:
            self.error = error
        finally:
            self.fn = self.args = None
            self.state = "done"
            if self.call is not None:
                self.call.job_ended(self.error)
            if self._done is not None:
                self._done.set()

    def cancel(self) -> bool:
        """Drop the job if it has not started; whether it was dropped."""
        if self.state == "queued":
            self.state = "cancelled"
            return True
        return self.state == "cancelled"

    def done(self) -> bool:
        return self.state in ("done", "cancelled")

    def result(self, timeout: float | None = None) -> Any:
        if self._done is not None and not self._done.wait(timeout):
            raise TimeoutError(f"the job did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.value


class Worker:
    """The one worker thread of a device: runs submitted jobs in order, for the life of the process."""

    def __init__(self, key: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"dpkit-{key}_0")
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job.run()
            del job  # hold nothing of a finished job while waiting for the next

    def submit(self, fn: Callable, *args: Any) -> Job:
        job = Job(fn, args)
        self.jobs.put(job)
        return job

    def stop(self) -> None:
        self.jobs.put(None)


_workers: dict[str, Worker] = {}
_abandoned: dict[str, Job] = {}  # device -> the unfinished job of an interrupted call
_workers_lock = threading.Lock()


def _stop_workers() -> None:
    """At interpreter exit, before threads are torn down, as concurrent.futures does for its own workers."""
    with _workers_lock:
        workers = list(_workers.values())
    for worker in workers:
        worker.stop()
    for worker in workers:
        worker.thread.join()


def _forget_workers_after_fork() -> None:
    """A forked child (a DataLoader worker) has none of the parent's threads: it starts its own if it runs
    replicas."""
    global _workers_lock
    _workers.clear()
    _abandoned.clear()
    _workers_lock = threading.Lock()


threading._register_atexit(_stop_workers)  # type: ignore[attr-defined]  # private, left out of typeshed
os.register_at_fork(after_in_child=_forget_workers_after_fork)


def worker_for(device: torch.device) -> Worker:
    """The one worker thread of a device, created on first use and kept for the process."""
    key = str(device)
    worker = _workers.get(key)
    if worker is None:
        with _workers_lock:
            if key not in _workers:
                _workers[key] = Worker(key)
            worker = _workers[key]
    return worker


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


def _passes_through(error: BaseException | None) -> bool:
    """Errors that end the program rather than the step: re-raised as they are, at once."""
    return isinstance(error, (KeyboardInterrupt, SystemExit))


def _run_job(
    job: Callable[[int], Any],
    index: int,
    device: torch.device,
    context: CallerContext,
    stream: Any,
    mode: ReplicaGenerator | None,
    threads: int | None,
    turns: Turns | None = None,
) -> Any:
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    with contextlib.ExitStack() as stack:
        stack.enter_context(device_context(device, stream))
        stack.enter_context(context.enter())
        if mode is not None:
            stack.enter_context(mode)
        stack.enter_context(hooks.replica(index, device))
        if turns is not None:
            with hooks.peer_wait():  # waiting for its turn is waiting for the other replicas
                taken = turns.lock.acquire(timeout=TURN_TIMEOUT_SECONDS)
            if taken:
                stack.callback(turns.lock.release)
            else:
                turns.peers_waited = True  # a job held its turn while it waited for the others
        return job(index)


class Turns:
    """Whether one call site's replica jobs run side by side or take turns (one at a time), learned from its
    runs: whichever made them shorter.

    Side by side, replica threads whose jobs are mostly Python (the forward of a model of many small layers)
    take the GIL from each other at nearly every operator, since torch lets it go for each, and every hand-over
    wakes a thread: the jobs together take longer than one after the other. Jobs that spend their time inside
    long operators (large matrix products), which run without the GIL, gain from running side by side. Both are
    the same computation; only the order of the threads' work differs, so results do not depend on it.

    The first runs alternate between the two ways (after a warm-up), then the faster by median is kept, and
    every `relearn` runs it is measured again. Jobs in turns first run in their worker threads, one holding the
    turn at a time; a job waits for its turn at most TURN_TIMEOUT_SECONDS and then runs anyway, so jobs that wait
    for each other (SyncBatchNorm's exchange, a user's own synchronisation between replicas) never deadlock, and
    such a wait is remembered (`peers_waited`). After SAFETY such runs with no wait, jobs in turns on virtual CPU
    devices run on the calling thread itself (`here()`), which saves handing each job to a thread and waking the
    caller; those runs, not the safety runs, are what turns are measured by there. A call site whose jobs waited
    for each other keeps its threads. `enabled=False`: always side by side (for measuring the difference).
    """

    WARMUP = 2
    SAMPLES = 4  # runs measured each way
    SAFETY = 2  # runs in turns in the worker threads, none waiting for another, before any on the calling thread

    def __init__(self, relearn: int = 500, enabled: bool = True):
        self.lock = threading.Lock()
        self.relearn = relearn
        self.enabled = enabled
        self.runs = 0
        self.seconds: dict[bool, list[float]] = {True: [], False: []}
        self.taking: bool | None = None  # decided: take turns or not; None while learning
        self.peers_waited = False  # a job waited past its turn's timeout: its jobs wait for each other
        self.clean_runs = 0  # runs in turns in the worker threads in which no job waited past its turn

    def __reduce__(self) -> tuple:
        return (type(self), (self.relearn, self.enabled))  # a copied or pickled wrapper learns again

    def next(self) -> bool:
        """Whether the next run takes turns."""
        if not self.enabled:
            return False
        forced = getattr(_forced, "way", None)
        if forced is not None:
            return forced
        if self.taking is not None:
            return self.taking
        return self.runs >= self.WARMUP and self.runs % 2 == 0

    def here(self) -> bool:
        """Whether jobs in turns may run on the calling thread: SAFETY runs in turns in the worker threads went by
        without a job waiting for the others, and turns are not ruled out."""
        forced = getattr(_forced, "way", None)
        if forced is not None:
            return forced and not self.peers_waited
        return self.taking is not False and not self.peers_waited and self.clean_runs >= self.SAFETY

    def counts(self, took_turns: bool, here: bool) -> bool:
        """Whether a run on virtual CPU devices measures its way: not a run in turns in the worker threads that
        only showed the jobs safe to move to the calling thread (where they then run, and are measured)."""
        return not took_turns or here or self.peers_waited

    def ran(self, took_turns: bool, seconds: float, counted: bool = True) -> None:
        """A run finished: learn from it (from its time when `counted`)."""
        if not self.enabled or getattr(_forced, "way", None) is not None:
            return
        self.runs += 1
        if self.taking is None:
            if self.runs > self.WARMUP and counted:
                self.seconds[took_turns].append(seconds)
            if all(len(values) >= self.SAMPLES for values in self.seconds.values()):
                medians = {way: sorted(values)[len(values) // 2] for way, values in self.seconds.items()}
                self.taking = medians[True] < medians[False]
        elif self.runs % self.relearn == 0:
            self.taking, self.seconds, self.runs = None, {True: [], False: []}, self.WARMUP


_forced = threading.local()  # .way: every Turns of this thread takes turns (True) or not (False); unset: learn


@contextlib.contextmanager
def turns_decided(way: bool) -> Iterator[None]:
    """Within the block, every call site's Turns in this thread runs its jobs in turns (`way` True: on the calling
    thread on virtual CPU devices) or side by side (False), and learns nothing: for measuring a model whose better
    way is known (dpkit.plan.probe's fixed models), as a call site runs once it has learned."""
    before = getattr(_forced, "way", None)
    _forced.way = way
    try:
        yield
    finally:
        _forced.way = before


def _wait_for_abandoned(devices: Sequence[torch.device]) -> None:
    """Before reusing a worker, let a job left running by an interrupted call finish (or say so)."""
    with _workers_lock:
        busy = [(str(d), _abandoned[str(d)]) for d in devices if str(d) in _abandoned]
    deadline = time.monotonic() + ABANDONED_WAIT_SECONDS
    for key, job in busy:
        while not job.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"device {key}: its worker thread is still running a replica job of an earlier call that was "
                    f"interrupted (waited {ABANDONED_WAIT_SECONDS:g} s); Python cannot stop it, so wait for it to "
                    "finish and call again, or restart the process"
                )
            time.sleep(min(0.01, left))
        with _workers_lock:
            if _abandoned.get(key) is job:
                del _abandoned[key]


def _abandon(devices: Sequence[torch.device], jobs: Sequence[Job]) -> None:
    """The caller leaves (Ctrl-C): drop jobs not started yet, remember the ones still running."""
    with _workers_lock:
        for device, job in zip(devices, jobs):
            if not job.cancel() and not job.done():
                _abandoned[str(device)] = job


def run_replicas(
    devices: Sequence[torch.device],
    job: Callable[[int], Any],
    *,
    generators: bool | RandomnessWatch = True,
    threads: int | None = None,
    on_interrupt: Callable[[], None] | None = None,
    turns: Turns | None = None,
    in_turns: Turns | None = None,
) -> list[Any]:
    """[job(0), …, job(n-1)], job(i) run in the worker thread of devices[i], all side by side.

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
        turns: the call site's Turns: its jobs run one at a time when that was learned to be faster.
        in_turns: run one at a time, as this Turns says (in the worker threads or on the calling thread), for a
            caller that chose to and measures the ways itself (it calls next() and ran()); instead of turns.

    With one device the job runs in the calling thread (nothing to run beside it); so do jobs in turns on
    virtual CPU devices once `turns` has learned that they may (Turns.here).
    """
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
    if _abandoned:
        _wait_for_abandoned(devices)
    learn = in_turns is None
    if not learn:
        turns = in_turns
    take_turns = turns is not None and (not learn or turns.next())
    if take_turns and on_cpu and turns is not None and turns.here():  # (take_turns: there are turns)
        return _run_in_turns_here(
            devices, job, context, modes, threads, turns if learn else None, on_interrupt, watch, state_before
        )
    call = _Call(n)
    jobs = [
        Job(_run_job, (job, i, device, context, stream, mode, threads, turns if take_turns else None), call)
        for i, (device, stream, mode) in enumerate(zip(devices, streams, modes))
    ]
    try:
        with hooks.handing_off(devices):
            began = time.perf_counter()
            for device, queued in zip(devices, jobs):
                worker_for(device).jobs.put(queued)
            call.wait()
            if turns is not None:
                if learn:
                    counted = not on_cpu or turns.counts(take_turns, here=False)
                    turns.ran(take_turns, time.perf_counter() - began, counted)
                if take_turns and not turns.peers_waited:
                    turns.clean_runs += 1
        for queued in jobs:
            if queued.error is not None and _passes_through(queued.error):
                raise queued.error
    except BaseException:
        if on_interrupt is not None:
            on_interrupt()
        _abandon(devices, jobs)
        raise
    failures = [(i, queued.error) for i, queued in enumerate(jobs) if queued.error is not None]
    if failures:
        first = next(((i, e) for i, e in failures if not isinstance(e, PeerFailed)), failures[0])
        _rethrow(first[0], devices[first[0]], first[1])
    if watch is not None:
        watch.end(modes, state_before)
    return [queued.value for queued in jobs]


def _run_in_turns_here(
    devices: list[torch.device],
    job: Callable[[int], Any],
    context: CallerContext,
    modes: Sequence[ReplicaGenerator | None],
    threads: int | None,
    turns: Turns | None,
    on_interrupt: Callable[[], None] | None,
    watch: RandomnessWatch | None,
    state_before: Any,
) -> list[Any]:
    """run_replicas' jobs in turns on virtual CPU devices: one after the other on the calling thread, each in its
    device's context, intra-op threads and generator as in its worker thread, so the results are the same, but
    without handing each job to a thread and waking the caller afterwards."""
    own_threads = torch.get_num_threads()
    results: list[Any] = []
    failure: tuple[int, torch.device, BaseException] | None = None
    began = time.perf_counter()
    try:
        for i, (device, mode) in enumerate(zip(devices, modes)):
            try:
                results.append(_run_job(job, i, device, context, None, mode, threads))
            except Exception as error:
                results.append(None)
                if failure is None or isinstance(failure[2], PeerFailed):
                    failure = (i, device, error)
    except BaseException:
        if on_interrupt is not None:
            on_interrupt()
        raise
    finally:
        if torch.get_num_threads() != own_threads:
            torch.set_num_threads(own_threads)
    if turns is not None:  # None: the caller measures
        turns.ran(True, time.perf_counter() - began)
    if failure is not None:
        _rethrow(*failure)
    if watch is not None:
        watch.end(modes, state_before)
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
    turns: Turns | None = None,
) -> list[Any]:
    """torch.nn.parallel.parallel_apply on dpkit's runner: modules[i](*inputs[i], **kwargs_tup[i]) on devices[i].

    As in torch, an input that is a tuple or a list is the argument list and anything else (a bare tensor)
    is one argument. Devices accept dpkit's specs: ints (CUDA indices), "cuda:1", "cpu:3", torch.device;
    without devices, each module runs on its input's device (CPU inputs on cpu:0, cpu:1, …). Outputs come
    in module order; an error names the replica and device. `generators` and `turns` are run_replicas'.
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

    return run_replicas(device_list, job, generators=generators, turns=turns)
