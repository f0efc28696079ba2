"""How a call site runs its replicas: the declared policy `concurrency="threads" | "serial" | "auto"`.

    threads  each replica's job in its device's worker thread, side by side (torch's parallel_apply)
    serial   one job after the other on the calling thread, each in its device's context, intra-op thread
             share and generator, as in its worker thread: no hand-off to a thread and no wake-up after
    auto     measured once, then frozen: the call site's first runs alternate between the two ways (WARMUP
             runs not counted, then SAMPLES of each); serial is chosen when its median is clearly smaller
             (by SERIAL_MARGIN) and its jobs are short (SERIAL_MAX_JOB_SECONDS), threads otherwise, and the
             choice is kept

Why two ways: replica threads whose jobs are mostly Python (a model of many small layers) hand the GIL to
each other at nearly every operator, so side by side takes longer than one after the other; jobs that spend
their time in long operators, which run without the GIL, gain from running side by side.

Why only short jobs may go serial: the choice is frozen for the whole run, so it must hold on the machine the
run will mostly see, not only in the seconds it was measured. While other processes keep the cores busy, the
replica threads seldom get two cores at once, so side by side gains little and still pays its hand-offs: serial
measured faster even on a compute-bound model, and frozen, its replicas then ran one after the other on one core
for the rest of the run, at up to half the speed once the cores were free (issue 41: `replicated` fell from 1.24x
to 0.98x torch DDP on `make bench`'s MLP; 4 of 6 processes chose serial somewhere on a shared 2-core machine, where
the learners before issue 31 never ran that model's jobs on the calling thread). What serial saves is bounded:
a hand-off per run (about 0.1 ms) and the GIL's hand-overs between replicas (a few microseconds per operator).
That is a visible part of a job of a millisecond or two (the launch-bound examples' jobs), and nothing beside a
job that takes SERIAL_MAX_JOB_SECONDS or more, whose operators are either long (they run side by side without
the GIL) or so many that the hand-overs cost a fraction of what side by side can gain. So a call site whose
shortest serial job (its run's time / its jobs, the least disturbed of the samples) takes longer keeps its
threads whatever the medians say; before issue 31 the same bound came from the 20 ms a job waited for its turn
before running anyway.

Results do not depend on the way, so neither do they on the machine's timing: each job runs the same
operators with the same intra-op thread count and its own generator either way, and sums across replicas
(reduce.py) add in replica order whichever thread adds. The choice is still a plain value a run records:
`Concurrency.choice()` says it ("threads" or "serial"; None while measuring) and `Concurrency(choice)` runs
that way from the first call, so a resumed run does what the saved one decided, without measuring again.

Jobs that wait for each other (SyncBatchNorm's exchange, a barrier of your own) need threads: serially the
first would wait for a replica that has not started. dpkit's own call sites with such waits run threads
whatever is declared, and a dpkit wait reached in a serial run raises (`check_may_wait_for_peers`).

An owner with several call sites (DataParallel: a forward in training mode and one in eval mode) keeps one
Concurrency per site (`site_policies`) and gives its choices back as a dict (`site_choices`), which its
`concurrency=` accepts again.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from collections.abc import Iterator, Mapping, Sequence

THREADS, SERIAL, AUTO = "threads", "serial", "auto"
WAYS = (THREADS, SERIAL)
CONCURRENCY_MODES = (THREADS, SERIAL, AUTO)


def check_concurrency(value: object, argument: str = "concurrency") -> str:
    """`value` as one of CONCURRENCY_MODES, else a one-line error naming the argument."""
    if not isinstance(value, str) or value not in CONCURRENCY_MODES:
        raise ValueError(f"{argument}: expected 'threads', 'serial' or 'auto', got {value!r}")
    return value


class Concurrency:
    """One call site's way of running its replicas: declared, or (auto) measured once and then frozen.

    Thread-safe: two threads running the same call site share the measurement under one lock."""

    WARMUP = 2  # runs not counted, one each way: first calls pay for allocations and caches
    SAMPLES = 4  # runs measured each way
    # serial wins only with a median this much smaller: its gain is the hand-offs saved, a cost that shows clearly
    # where it matters (many small operators), while a near tie is noise, and threads gain where cores are idle
    SERIAL_MARGIN = 0.05
    # serial only where its jobs are short: what it saves per run is bounded (see the module's doc), what it gives
    # up on a machine whose cores come free is the jobs' overlap; the launch-bound examples' jobs take 0.5 - 2 ms
    SERIAL_MAX_JOB_SECONDS = 0.005

    def __init__(self, concurrency: str = AUTO, *, argument: str = "concurrency"):
        self.declared = check_concurrency(concurrency, argument)
        self._lock = threading.Lock()
        self._chosen: str | None = None if self.declared == AUTO else self.declared
        self._runs = 0
        self._seconds: dict[str, list[float]] = {THREADS: [], SERIAL: []}
        self._serial_job_seconds: list[float] = []  # each counted serial run's seconds per job, where given

    def choice(self) -> str | None:
        """The way this call site runs from now on: 'threads' or 'serial'; None while auto still measures."""
        with self._lock:
            return self._chosen

    def way(self) -> str:
        """How the next run goes: the choice, a way forced for this thread (`concurrency_decided`), or the
        next way to measure."""
        forced = getattr(_decided, "way", None)
        if forced is not None and self.declared == AUTO:
            return forced
        with self._lock:
            if self._chosen is not None:
                return self._chosen
            return WAYS[self._runs % 2]  # alternate, so a change in the machine's load hits both alike

    def ran(self, way: str, seconds: float, jobs: int | None = None) -> None:
        """A run in `way` of `jobs` replica jobs took `seconds`: auto counts it, and chooses once it has SAMPLES
        of each way (serial only if clearly faster and, where `jobs` was given, its jobs short)."""
        if getattr(_decided, "way", None) is not None:
            return  # a forced run measures the forced way, not this call site's choice
        with self._lock:
            if self._chosen is not None:
                return
            self._runs += 1
            if self._runs <= self.WARMUP:
                return
            self._seconds[way].append(seconds)
            if way == SERIAL and jobs:
                self._serial_job_seconds.append(seconds / jobs)
            if all(len(values) >= self.SAMPLES for values in self._seconds.values()):
                medians = {w: statistics.median(values) for w, values in self._seconds.items()}
                clearly_faster = medians[SERIAL] < (1.0 - self.SERIAL_MARGIN) * medians[THREADS]
                # the shortest: a busy machine only lengthens a job, so it is the one closest to the job's own time
                short = min(self._serial_job_seconds, default=0.0) <= self.SERIAL_MAX_JOB_SECONDS
                self._chosen = SERIAL if clearly_faster and short else THREADS

    def measured(self) -> dict[str, list[float]]:
        """The seconds auto measured each way (empty for a declared way)."""
        with self._lock:
            return {w: list(values) for w, values in self._seconds.items()}

    def __reduce__(self) -> tuple:
        # a copy keeps the choice (the lock cannot be copied); one made while measuring measures again
        return (type(self), (self.choice() or self.declared,))

    def __repr__(self) -> str:
        return f"Concurrency({self.declared!r}, choice={self.choice()!r})"


def site_policies(
    concurrency: str | Mapping[str, str], sites: Sequence[str], *, argument: str = "concurrency"
) -> dict[str, Concurrency]:
    """One Concurrency per call site from what an owner was given: one mode for every site, or a dict of
    site -> mode (what `site_choices` returned; a site it leaves out is auto)."""
    if isinstance(concurrency, str):
        check_concurrency(concurrency, argument)
        return {site: Concurrency(concurrency, argument=argument) for site in sites}
    if not isinstance(concurrency, Mapping):
        raise TypeError(
            f"{argument}: expected 'threads', 'serial', 'auto' or a dict of call site -> one of them "
            f"(sites: {', '.join(sites)}), got {type(concurrency).__name__}"
        )
    unknown = [site for site in concurrency if site not in sites]
    if unknown:
        raise ValueError(f"{argument}: {unknown[0]!r} is not a call site here; the call sites are {', '.join(sites)}")
    return {site: Concurrency(concurrency.get(site, AUTO), argument=f"{argument}[{site!r}]") for site in sites}


def site_choices(policies: Mapping[str, Concurrency]) -> dict[str, str]:
    """The call sites' frozen ways, as a plain dict to record (sites still measuring are left out)."""
    return {site: way for site, policy in policies.items() if (way := policy.choice()) is not None}


_decided = threading.local()  # .way: every auto call site run by this thread runs this way and measures nothing


@contextlib.contextmanager
def concurrency_decided(way: str) -> Iterator[None]:
    """Within the block, every auto call site run from this thread runs `way` ('threads' or 'serial') and
    measures nothing: for measuring a model whose better way is known (plan/probe.py's fixed models)."""
    if way not in WAYS:
        raise ValueError(f"way: expected 'threads' or 'serial', got {way!r}")
    before = getattr(_decided, "way", None)
    _decided.way = way
    try:
        yield
    finally:
        _decided.way = before


_serial = threading.local()  # .running: this thread is running replica jobs one after the other


@contextlib.contextmanager
def running_serially() -> Iterator[None]:
    before = getattr(_serial, "running", False)
    _serial.running = True
    try:
        yield
    finally:
        _serial.running = before


def check_may_wait_for_peers(what: str) -> None:
    """Before a replica job waits for the others: in a serial run they would never come."""
    if getattr(_serial, "running", False):
        raise RuntimeError(
            f"{what}: a replica waits for the other replicas, but they run one after the other on this thread "
            "(concurrency='serial' or auto's choice); declare concurrency='threads' for this call site"
        )
