"""The step by thread: what the calling thread does itself, how long it waits for the replica threads, and
what each replica thread does meanwhile.

One process drives every device with one Python thread each, so a short step can be slow for reasons that
are no layer's: replica threads take turns at the GIL, jobs travel to worker threads and results come back,
and the calling thread scatters, replicates and gathers on its own. This module splits the wall time of the
observed steps so that every part is named:

- the calling thread's wall time goes, moment by moment, to the innermost of: a phase it runs itself
  (scatter, replicate, gather, loss, backward, optimizer, ...), waiting for the replica threads (inside the
  replica runner), an observer's own bookkeeping ("observer"), or "other" (outside any phase: the user's
  loop, the Engine);
- every wait for the replica threads splits, for each replica thread, into its hand-off (from the moment
  the caller hands the jobs over until that thread's job starts, and from the last job's end until the
  caller runs again), its job (on the CPU; runnable but descheduled, as when other processes use the
  cores; off the CPU otherwise: waiting for the GIL, mostly; and explicitly waiting for the other replicas:
  its turn, the gradient sum's queue, SyncBatchNorm's exchange) and, after its job, waiting for the slowest
  replica's job. A thread whose job starts while another replica's job runs was waiting for the GIL to
  start: that part of its start is booked as GIL, not hand-off. Those parts add up to the caller's wait,
  for every replica thread that took part;
- replica jobs that the runner runs in turns on the calling thread itself (no hand-off, no replica thread)
  are the calling thread's "replicas" phase.

On-CPU time is the thread's CPU clock; descheduled time is the kernel's per-thread run-queue delay
(/proc/thread-self/schedstat; 0 where there is none, and then it counts as off the CPU). Off-CPU time
inside a job is taken for GIL waits: with several intra-op threads per device it also holds waits for them.
Each reading costs a microsecond or less; only started observers read.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpkit.observe.timing import PHASES

_SCHEDSTAT = "/proc/thread-self/schedstat"
_local = threading.local()  # .schedstat: this thread's open schedstat file (or None when there is none)

OTHER = "other"  # the calling thread outside any phase
OBSERVER = "observer"  # the calling thread doing an observer's bookkeeping (marking autograd nodes, ...)
WAITING = "waiting"  # the calling thread inside the replica runner, waiting for the replica threads
REPLICAS = "replicas"  # the calling thread running the replicas' jobs itself, in turns (parallel/apply.py)
# a replica thread's share of each wait, in the order they are printed
REPLICA_PARTS = ("running", "gil", "descheduled", "peers", "hand_off")


class _SchedStat:
    """This thread's /proc/thread-self/schedstat, kept open (reread with pread), closed with the thread."""

    def __init__(self) -> None:
        self.fd = os.open(_SCHEDSTAT, os.O_RDONLY)

    def runnable_seconds(self) -> float:
        fields = os.pread(self.fd, 64, 0).split()
        return int(fields[1]) / 1e9

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _schedstat() -> _SchedStat | None:
    if hasattr(_local, "schedstat"):
        return _local.schedstat
    stat: _SchedStat | None
    try:
        stat = _SchedStat()
        stat.runnable_seconds()
    except (OSError, ValueError, IndexError):
        stat = None
    _local.schedstat = stat
    return stat


# (wall, on-CPU, runnable-but-descheduled) seconds of a thread
Clock = tuple[float, float, float]


def thread_clock() -> Clock:
    """(wall, on-CPU, runnable-but-descheduled) seconds of the current thread, for differences."""
    stat = _schedstat()
    return time.perf_counter(), time.thread_time(), stat.runnable_seconds() if stat is not None else 0.0


@dataclass
class _Job:
    """One replica job's times, written by its thread."""

    start: Clock
    end: Clock | None = None
    peer_seconds: float = 0.0


@dataclass
class _Jobs:
    """One hand-off of jobs to the replica threads (one run of the replica runner)."""

    devices: list[str]
    submitted: Clock
    jobs: dict[str, _Job] = field(default_factory=dict)


def _overlap(start: float, end: float, spans: Sequence[tuple[float, float]]) -> float:
    """How much of [start, end] the union of `spans` covers."""
    covered, reach = 0.0, start
    for lo, hi in sorted(spans):
        lo, hi = max(lo, reach), min(hi, end)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered


class StepSplit:
    """Accumulates the split for one observer. The thread that calls `start` is the calling thread."""

    def __init__(self) -> None:
        self.caller: int | None = None
        self.started: Clock | None = None  # thread_clock() readings
        self.stopped: Clock | None = None
        self._stack: list[str] = [OTHER]
        self._last = 0.0
        self.caller_seconds: dict[str, float] = {}
        self.caller_waits: list[float] = [0.0, 0.0, 0.0]  # wall, cpu, runnable inside waits
        self.hand_offs = 0
        self.replica_seconds: dict[str, dict[str, float]] = {}
        self.replica_jobs: dict[str, int] = {}
        self._current: _Jobs | None = None
        self._thread = threading.local()  # .job: the replica job running in this thread

    # --- the calling thread ----------------------------------------------------------------------------
    def start(self) -> None:
        self.caller = threading.get_ident()
        self.started = thread_clock()
        self._last = self.started[0]

    def stop(self) -> None:
        if self.caller is None or self.started is None or self.stopped is not None:  # (start sets both)
            return
        if threading.get_ident() == self.caller:
            self.stopped = thread_clock()
        else:
            self.stopped = (time.perf_counter(), self.started[1], self.started[2])  # no CPU reading of another thread
        self._move(self.stopped[0])

    def _move(self, now: float) -> None:
        top = self._stack[-1]
        self.caller_seconds[top] = self.caller_seconds.get(top, 0.0) + (now - self._last)
        self._last = now

    def enter(self, name: str) -> None:
        """The calling thread enters phase `name` (ignored from any other thread)."""
        if threading.get_ident() == self.caller and self.stopped is None:
            self._move(time.perf_counter())
            self._stack.append(name)

    def leave(self, name: str) -> None:
        if threading.get_ident() == self.caller and self.stopped is None and self._stack[-1] == name:
            self._move(time.perf_counter())
            self._stack.pop()

    @contextlib.contextmanager
    def handing_off(self, devices: Sequence[Any]) -> Iterator[None]:
        """The calling thread hands one job to each replica thread and waits for them all."""
        if threading.get_ident() != self.caller or self.stopped is not None or self._current is not None:
            yield
            return
        submitted = thread_clock()
        self._move(submitted[0])
        self._stack.append(WAITING)
        jobs = self._current = _Jobs([str(d) for d in devices], submitted)
        try:
            yield
        finally:
            self._current = None
            resumed = thread_clock()
            self._move(resumed[0])
            self._stack.pop()
            for k in range(3):
                self.caller_waits[k] += resumed[k] - submitted[k]
            self._settle(jobs, resumed[0])

    def _settle(self, jobs: _Jobs, resumed: float) -> None:
        ends = {device: job.end for device, job in jobs.jobs.items() if job.end is not None}
        if not ends:
            return
        self.hand_offs += 1
        last_end = max(end[0] for end in ends.values())
        for device in jobs.devices:  # in device order
            end = ends.get(device)
            if end is None:
                continue
            job = jobs.jobs[device]
            wall = end[0] - job.start[0]
            running = min(max(end[1] - job.start[1], 0.0), wall)
            descheduled = min(max(end[2] - job.start[2], 0.0), wall - running)
            peers = min(job.peer_seconds, wall - running - descheduled)
            # before its job starts, a thread needs the GIL: while another replica's job runs, that is its wait
            others = [(jobs.jobs[key].start[0], other_end[0]) for key, other_end in ends.items() if key != device]
            late = _overlap(jobs.submitted[0], job.start[0], others)
            parts = {
                "running": running,
                "gil": wall - running - descheduled - peers + late,
                "descheduled": descheduled,
                "peers": peers + (last_end - end[0]),
                "hand_off": (job.start[0] - jobs.submitted[0] - late) + (resumed - last_end),
            }
            totals = self.replica_seconds.setdefault(device, dict.fromkeys(REPLICA_PARTS, 0.0))
            for part, seconds in parts.items():
                totals[part] += seconds
            self.replica_jobs[device] = self.replica_jobs.get(device, 0) + 1

    # --- the replica threads ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def job(self, device: str) -> Iterator[None]:
        """Around a replica's job, in its thread (or in the calling thread, when the jobs take turns there)."""
        jobs = self._current
        if threading.get_ident() == self.caller:
            if jobs is not None:
                yield
                return
            self.enter(REPLICAS)
            try:
                yield
            finally:
                self.leave(REPLICAS)
            return
        if jobs is None or device not in jobs.devices:
            yield
            return
        job = _Job(thread_clock())
        outer, self._thread.job = getattr(self._thread, "job", None), job
        try:
            yield
        finally:
            self._thread.job = outer
            job.end = thread_clock()
            jobs.jobs[device] = job

    @contextlib.contextmanager
    def peer_wait(self) -> Iterator[None]:
        """Inside a replica's job: a wait for the other replicas."""
        job = getattr(self._thread, "job", None)
        if job is None:
            yield
            return
        began = time.perf_counter()
        try:
            yield
        finally:
            job.peer_seconds += time.perf_counter() - began

    # --- the result ------------------------------------------------------------------------------------
    def summary(self, steps: int, memory_accounting: bool) -> dict[str, Any] | None:
        """Seconds per step (per observation when no step was counted), as Report.threads holds them."""
        if self.started is None:
            return None
        if self.stopped is None:
            now = time.perf_counter()
            self._move(now)
            end = (now, self.started[1], self.started[2]) if threading.get_ident() != self.caller else thread_clock()
        else:
            end = self.stopped
        per = max(steps, 1)
        own = {name: seconds for name, seconds in self.caller_seconds.items() if name != WAITING}
        own_wall = sum(own.values())
        wall = end[0] - self.started[0]
        cpu = max(end[1] - self.started[1] - self.caller_waits[1], 0.0)
        runnable = max(end[2] - self.started[2] - self.caller_waits[2], 0.0)
        running = min(cpu, own_wall)
        descheduled = min(runnable, own_wall - running)
        order = [*PHASES, OBSERVER, OTHER]
        order.insert(order.index("replicate") + 1 if "replicate" in order else 0, REPLICAS)
        return {
            "steps": steps,
            "memory_accounting": memory_accounting,
            "step_seconds": wall / per,
            "calling_thread": {
                "own_seconds": own_wall / per,
                "own_seconds_by_phase": {
                    name: own[name] / per
                    for name in sorted(own, key=lambda n: order.index(n) if n in order else len(order))
                },
                "running_seconds": running / per,
                "descheduled_seconds": descheduled / per,
                "blocked_seconds": (own_wall - running - descheduled) / per,
                "waiting_seconds": self.caller_seconds.get(WAITING, 0.0) / per,
                "hand_offs": self.hand_offs / per,
            },
            "replica_threads": [
                {
                    "device": device,
                    "jobs": self.replica_jobs[device] / per,
                    **{f"{part}_seconds": seconds / per for part, seconds in parts.items()},
                }
                for device, parts in self.replica_seconds.items()
            ],
        }
