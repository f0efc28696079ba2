"""The worker threads of the replica runner: one per device, each running the jobs queued to it in order.

parallel/apply.py queues a run's jobs here and waits for them (`Call`); everything about the threads' lifetime
lives here. The threads are process-wide state (docs/architecture.md#process-wide-state): started on a device's
first job, daemon threads (an idle one never holds up the interpreter's exit, nor does one still running a job
that Ctrl-C abandoned), and stopped when the last `hold_workers()` lease is released (the Engine holds one for
its life) or by `stop_workers()`; a later job starts them again.

Python cannot stop a running thread, so the jobs of an interrupted call run on. The next call that needs a worker
still busy with such an abandoned job waits for it (still interruptible) for up to ABANDONED_WAIT_SECONDS and then
raises a RuntimeError naming the device, rather than starting a second thread on a replica whose tensors the old
job may still be writing, or hanging silently.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar, cast

import torch

T = TypeVar("T")

# how long the caller sleeps between checks for Ctrl-C while it waits for replicas
WAIT_SLICE_SECONDS = 0.05
# how long a call waits for a worker still running a job of an earlier, interrupted call
ABANDONED_WAIT_SECONDS = 10.0


def passes_through(error: BaseException | None) -> bool:
    """Errors that end the program rather than the step: re-raised as they are, at once."""
    return isinstance(error, (KeyboardInterrupt, SystemExit))


class Call:
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
            if (self.left == 0 or passes_through(error)) and not self.open:
                self.open = True
                self.finished.release()

    def wait(self) -> None:
        """Until finished; in slices, so a signal in the caller is handled within one."""
        while not self.finished.acquire(timeout=WAIT_SLICE_SECONDS):
            pass


class Job(Generic[T]):
    """A function queued on a device's worker thread: what concurrent.futures.Future offers that dpkit uses
    (result, done, cancel), without a condition variable per job."""

    __slots__ = ("fn", "args", "call", "state", "value", "error", "_done")

    def __init__(self, fn: Callable[..., T], args: tuple[object, ...], call: Call | None = None):
        self.fn: Callable[..., T] | None = fn  # None once it ran: the job keeps no reference to its work
        self.args: tuple[object, ...] | None = args
        self.call = call
        self.state = "queued"  # -> "running" -> "done", or "cancelled" before it runs
        self.value: T | None = None  # what fn returned, once it ran without error
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

    def result(self, timeout: float | None = None) -> T:
        """What fn returned (a lone job: once it ran; a run_replicas job: read after its call finished)."""
        if self._done is not None and not self._done.wait(timeout):
            raise TimeoutError(f"the job did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return cast(T, self.value)  # (None only before it ran)


class Worker:
    """The one worker thread of a device: runs submitted jobs in order until stopped."""

    def __init__(self, key: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name=f"dpkit-{key}_0", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job.run()
            del job  # hold nothing of a finished job while waiting for the next

    def submit(self, fn: Callable[..., T], *args: object) -> Job[T]:
        """fn(*args) on this thread, after the jobs queued before it (a job of its own, outside run_replicas)."""
        job = Job(fn, args)
        with _workers_lock:  # as stop_workers: a job is queued before a stop, or refused
            if self.stopped:
                raise RuntimeError(f"{self.thread.name}: this worker was stopped; take the device's worker again")
            self.jobs.put(job)
        return job

    def stop(self) -> None:
        """Under _workers_lock: the thread ends after the jobs queued before."""
        self.stopped = True
        self.jobs.put(None)


_workers: dict[str, Worker] = {}
abandoned: dict[str, Job] = {}  # device -> the unfinished job of an interrupted call
_workers_lock = threading.Lock()  # guards both dicts, and orders every job put before a worker's stop
_leases = 0  # hold_workers() leases not yet released


def _forget_workers_after_fork() -> None:
    """A forked child (a DataLoader worker) has none of the parent's threads, and the parent's lock may have
    been held at the fork: it starts afresh if it runs replicas."""
    global _workers_lock, _leases
    _workers.clear()
    abandoned.clear()
    _workers_lock = threading.Lock()
    _leases = 0


# process-wide and cannot be undone; without it a forked child would queue jobs on threads it does not have
os.register_at_fork(after_in_child=_forget_workers_after_fork)


def _worker_for_locked(key: str) -> Worker:
    worker = _workers.get(key)
    if worker is None:
        worker = _workers[key] = Worker(key)
    return worker


def worker_for(device: torch.device) -> Worker:
    """The worker thread of a device, started on first use and kept until the workers are stopped."""
    with _workers_lock:
        return _worker_for_locked(str(device))


def queue_jobs(devices: Sequence[torch.device], jobs: Sequence[Job]) -> None:
    """Each job on its device's worker, under the lock that stop_workers takes: no job lands behind a stop."""
    with _workers_lock:
        for device, job in zip(devices, jobs):
            _worker_for_locked(str(device)).jobs.put(job)


def stop_workers(timeout_seconds: float = 10.0) -> None:
    """Stop every idle worker thread and wait for it; a worker still running a job that Ctrl-C abandoned
    stops after that job (it is a daemon thread: it never holds up the interpreter's exit)."""
    with _workers_lock:
        workers = list(_workers.items())
        _workers.clear()
        busy = set(abandoned)
        for _, worker in workers:
            worker.stop()
    deadline = time.monotonic() + timeout_seconds
    for key, worker in workers:
        if key not in busy and worker.thread is not threading.current_thread():  # (a job may close an Engine)
            worker.thread.join(max(0.0, deadline - time.monotonic()))


class WorkerLease:
    """Keeps the worker threads while held; the last lease released stops them (hold_workers)."""

    def __init__(self) -> None:
        self._held = True

    def release(self) -> None:
        """Idempotent; the last lease out stops the workers."""
        global _leases
        with _workers_lock:
            if not self._held:
                return
            self._held = False
            _leases -= 1
            last = _leases == 0
        if last:
            stop_workers()

    def __enter__(self) -> WorkerLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold_workers() -> WorkerLease:
    """A lease on the worker threads: they are stopped when the last lease is released (the Engine holds one
    from its creation to close()). Runs without a lease (DataParallel on its own) keep them for the process."""
    global _leases
    with _workers_lock:
        _leases += 1
    return WorkerLease()


def wait_for_abandoned(devices: Sequence[torch.device]) -> None:
    """Before reusing a worker, let a job left running by an interrupted call finish (or say so)."""
    if not abandoned:  # (every call asks: one check of an empty dict)
        return
    with _workers_lock:
        busy = [(str(d), abandoned[str(d)]) for d in devices if str(d) in abandoned]
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
            if abandoned.get(key) is job:
                del abandoned[key]


def abandon(devices: Sequence[torch.device], jobs: Sequence[Job]) -> None:
    """The caller leaves (Ctrl-C): drop jobs not started yet, remember the ones still running."""
    with _workers_lock:
        for device, job in zip(devices, jobs):
            if not job.cancel() and not job.done():
                abandoned[str(device)] = job
