"""How a launch fails: the errors, which worker failed first, and the one-line summary.

torchrun's failure timestamps count whole seconds, and the agent polls its workers every monitor interval,
so a worker that died of another's failure (its collective lost its peer) can look as early as the culprit;
`ExitWatch` notes when each worker exited, and the summary puts the first to fail first.

A worker that exits with 2 (bad input: dpkit's one-line refusals) or 3 (the training diverged) would fail the
same way again: `deterministic_failure` tells the agent not to restart the group for it (agent.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from dpkit.errors import DpkitError

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

log = logging.getLogger("dpkit")

# exit codes of a failure that a restart would only repeat, and what they mean: dpkit's one-line refusals of
# bad input (also argparse's), and a run whose loss became nan/inf (dpkit.recipe.recipe.TrainingDiverged)
DETERMINISTIC_EXIT_CODES = {2: "bad input", 3: "training diverged"}
# how a worker ends when torchrun's agent stops it (SIGTERM) because another failed: the signal, or 128 + it
# from dpkit's own handler (a step boundary, as Ctrl-C)
_STOPPED_BY_AGENT = {-int(signal.SIGTERM), 128 + int(signal.SIGTERM)}


class LaunchError(DpkitError):
    """A worker process failed; the message names its rank, exit code and error. `exit_codes` maps each
    failed worker's rank to its exit code (negative: killed by that signal)."""

    def __init__(self, message: str, exit_codes: dict[int, int] | None = None, exit_code: int = 1):
        super().__init__(message)
        self.exit_codes = dict(exit_codes or {})
        # what `dpkit launch` exits with: the worker's own 2 (bad input) or 3 (diverged) when that failure was
        # deterministic, else 1, a failure (a crash, a kill): never 2, which says the input was bad and a requeue
        # script would give up on
        self.exit_code = exit_code


class StoppedBySignal(DpkitError):
    """The run was stopped by SIGINT or SIGTERM; `exit_code` is 128 + the signal number, as a shell reports it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


def failure_order(failures: dict[int, ProcessFailure], exit_times: dict[int, float] | None = None) -> list[int]:
    """The failed ranks, the first to fail first.

    By `exit_times` (pid -> when the launcher saw that worker exit, `ExitWatch`) where every failure has
    one, else by torchrun's timestamps (whole seconds). Among exits at the same time, one killed by a
    signal comes after one that exited with an error code: a worker aborting (SIGABRT) because its peer's
    connection closed is a consequence; then by rank.
    """
    exit_times = exit_times or {}
    precise = bool(failures) and all(failure.pid in exit_times for failure in failures.values())

    def key(rank: int) -> tuple:
        failure = failures[rank]
        when = exit_times[failure.pid] if precise else getattr(failure, "timestamp", 0)
        killed = failure.exitcode is not None and failure.exitcode < 0
        return when, killed, rank

    return sorted(failures, key=key)


def deterministic_failure(
    failures: dict[int, ProcessFailure], exit_times: dict[int, float] | None = None
) -> int | None:
    """The exit code (2 or 3, DETERMINISTIC_EXIT_CODES) when a restart would only repeat this failure, else None.

    That is when some worker exited with 2 or 3 and every other failed worker either did too or was stopped by
    the agent because of it (SIGTERM, or 143 from dpkit's handler). A crash, an exit 1 or another signal
    anywhere (SIGKILL, out of memory, the hang watch) may be the cause of it all: that is retried. With 2 and 3
    both there, the first to fail decides.
    """
    codes = [failure.exitcode for failure in failures.values()]
    if not any(code in DETERMINISTIC_EXIT_CODES for code in codes):
        return None
    if not all(code in DETERMINISTIC_EXIT_CODES or code in _STOPPED_BY_AGENT for code in codes):
        return None
    for rank in failure_order(failures, exit_times):
        if failures[rank].exitcode in DETERMINISTIC_EXIT_CODES:
            return failures[rank].exitcode
    return None


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended on this machine since boot (Linux's
    /proc/vmstat), or None where that is not known."""
    try:
        with open("/proc/vmstat") as vmstat:
            for line in vmstat:
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def _who_killed(oom_kills_during: int | None) -> str:
    """Why a worker got SIGKILL, as far as this machine can tell: memory, or another process."""
    if oom_kills_during is None:
        return ""
    if oom_kills_during > 0:
        return f" (out of memory: the kernel killed {oom_kills_during} process(es) for memory during the launch)"
    return (
        " (not for memory: the kernel killed no process for memory during the launch; nor by dpkit's hang watch, "
        "which names the ranks it stops: another process sent it, such as a scheduler or a `kill -9`)"
    )


def failure_summary(
    error: BaseException,
    hung: dict[int, str] | None = None,
    exit_times: dict[int, float] | None = None,
    not_retried: bool = False,
    output_note: str = "each worker's own output is above",
    oom_kills_during: int | None = None,
    collectives: dict[int, dict] | None = None,
    fatal_stacks: dict[int, str] | None = None,
) -> str:
    """The failed workers first, the first to fail first (a rank the hang watch stopped, named with why),
    then the ones the agent stopped (SIGTERM) because of them. `exit_times`: pid -> monotonic exit time.
    `not_retried`: the agent did not restart the group although restarts were left, as the failure would only
    repeat (exit 2 or 3): the summary says what the code means and that it was not retried. `output_note`: where
    the failed workers' own output is, at the end in brackets. `oom_kills_during`: the out-of-memory kills the
    kernel counted during the launch (`oom_kills`), which say whether a SIGKILL came for memory. `collectives`: each
    rank's last recorded collective (the hang watch's), and `fatal_stacks`: where the user's code of a rank that
    died of a signal was (hang_watch.fatal_stack), both said for a rank killed by a signal (gloo's abort when
    collectives of different sizes met). A rank whose error line is the same as an earlier one's says so."""
    from dpkit.launch.hang_watch import describe_collective

    failures = getattr(error, "failures", {}) or {}
    hung = hung or {}
    collectives, fatal_stacks = collectives or {}, fatal_stacks or {}
    failed, stopped = [hung[rank] for rank in sorted(hung) if hung[rank]], []
    details: set[str] = set()
    for rank in failure_order(failures, exit_times):
        failure = failures[rank]
        if rank in hung:
            continue
        if (
            (failure.exitcode is not None and failure.exitcode == -signal.SIGTERM)
            or hung
            or (not_retried and failure.exitcode in _STOPPED_BY_AGENT)
        ):
            stopped.append(str(rank))  # with a hung rank found, the others failed because of it
            continue
        how = (
            f"was killed by signal {failure.signal_name()}"
            if failure.exitcode is not None and failure.exitcode < 0
            else f"exited with code {failure.exitcode}"
        )
        if failure.exitcode == -signal.SIGKILL:
            how += _who_killed(oom_kills_during)
        if not_retried and failure.exitcode in DETERMINISTIC_EXIT_CODES:
            how += f" ({DETERMINISTIC_EXIT_CODES[failure.exitcode]}, not retried)"
        message = failure.message if isinstance(failure.message, str) else (failure.message or {}).get("message", "")
        detail = "" if not message or "elastic/errors.html" in str(message) else str(message).strip().splitlines()[-1]
        if failure.exitcode is not None and failure.exitcode < 0:
            if rank in collectives:
                how += f"; its last collective: {describe_collective(collectives[rank])}"
            if rank in fatal_stacks:
                how += f"; it was at {fatal_stacks[rank]}"
        if detail and detail in details:
            detail = "the same error"
        elif detail:
            details.add(detail)
        failed.append(
            f"worker rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}"
            + (f": {detail}" if detail else "")
        )
    if not failed and not stopped:
        return str(error)
    summary = "; ".join(failed) if failed else "workers were stopped"
    if stopped:
        summary += f"; the launcher then stopped worker rank(s) {', '.join(sorted(stopped, key=int))}"
        killed = any(f.exitcode is not None and f.exitcode < 0 for r, f in failures.items() if str(r) not in stopped)
        waiting = [int(r) for r in stopped if int(r) in collectives]
        if killed and waiting and not hung:  # what the others were in when a rank died (gloo aborts on a peer)
            summary += "".join(f"; rank {r} was in {describe_collective(collectives[r])}" for r in sorted(waiting))
    return summary + f" ({output_note})"


class ExitWatch:
    """When each child process of the launcher exited, by its monotonic clock: `exit_times`, pid -> time.

    Linux only (elsewhere `exit_times` stays empty and the summary orders by torchrun's timestamps). A
    thread opens a pidfd for each child process (the workers torchrun's agent starts), which becomes
    readable when that child exits, whether or not the agent has reaped it yet, and waits on them all at
    once: two exits are told apart unless they happen within the same wake-up of the thread. Children are
    looked for (in /proc; those from before `start` are not workers) only while fewer than `expected` of
    them are being watched, so a running job costs nothing; after a restart the new workers are found
    the same way.
    """

    def __init__(self, expected: int, find_interval_seconds: float = 0.05):
        self.expected = expected
        self.find_interval_seconds = find_interval_seconds
        self.exit_times: dict[int, float] = {}
        self._watched: dict[int, int] = {}  # pidfd -> pid
        self._earlier: set[int] = set()  # children from before start: not workers
        self._poller: select.poll | None = None  # made by start, where pidfds can be watched
        self._wake_read = self._wake_write = -1
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="dpkit-exit-watch", daemon=True)

    @staticmethod
    def available() -> bool:
        return (
            sys.platform.startswith("linux")
            and hasattr(os, "pidfd_open")
            and hasattr(select, "poll")
            and os.path.isdir("/proc/self")
        )

    def start(self) -> ExitWatch:
        if self.available():
            self._poller = select.poll()
            self._earlier = set(self._children())
            self._wake_read, self._wake_write = os.pipe()
            self._poller.register(self._wake_read, select.POLLIN)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Note the exits that happened since the thread last looked (at the time of this call: later than any
        exit it has noted), end the thread and close its descriptors. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if self._poller is None:
            return
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            return  # the descriptors stay open rather than closed under a running thread
        with contextlib.suppress(Exception):
            self._note_exits(0)
        for fd in list(self._watched):
            os.close(fd)
        self._watched.clear()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _children(self) -> list[int]:
        me, children = os.getpid(), []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    fields = handle.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone meanwhile
            if len(fields) > 1 and int(fields[1]) == me:
                children.append(int(entry))
        return children

    def _find_children(self) -> None:
        watched = set(self._watched.values())
        for pid in self._children():
            if pid in watched or pid in self.exit_times or pid in self._earlier:
                continue  # watched, or exited and not reaped yet
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue  # exited and reaped meanwhile (or pidfds are not allowed here)
            self._watched[fd] = pid
            self._started_poller().register(fd, select.POLLIN)

    def _note_exits(self, timeout_ms: int | None) -> bool:
        """Wait up to timeout_ms (None: for ever) for an exit or stop; returns False once stopped."""
        poller = self._started_poller()
        events = poller.poll(timeout_ms)
        now = time.monotonic()
        running = True
        for fd, _ in events:
            if fd == self._wake_read:
                running = False
                continue
            pid = self._watched.pop(fd, None)
            if pid is None:
                continue
            poller.unregister(fd)
            os.close(fd)
            self.exit_times.setdefault(pid, now)
        return running

    def _started_poller(self) -> select.poll:
        assert self._poller is not None  # (the thread runs, and stop reads the exits, only after start made it)
        return self._poller

    def _run(self) -> None:
        try:
            while True:
                finding = len(self._watched) < self.expected
                if finding:
                    self._find_children()
                if not self._note_exits(int(self.find_interval_seconds * 1000) if finding else None):
                    return
        except Exception as error:  # never fail the launch over this; the summary falls back on torchrun's order
            log.debug("launch: exit watch stopped: %s", error)
