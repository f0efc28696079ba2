"""The worker's side of the hang watch: how far this rank is, published for the launcher, and `busy()`, with
which a rank says it is working (saving a state, say) rather than hung.

With the count goes this rank's last recorded collective (observe/collectives.py: op, sequence, step, the
user's call site) on a second line, so the launcher's report names each rank's collective and line."""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections.abc import Iterator
from datetime import timedelta

from dpkit.checks import check_number
from dpkit.launch.environment import STACKS_DIR_VARIABLE, collective_file, heartbeat_key

# busy() counts as progress for at most this many times the launcher's hang timeout, unless it says otherwise
BUSY_LIMIT_FACTOR = 10


class _Busy:
    """This process's busy state (one rank per process): nesting depth, which block (a number that grows with
    every outermost entry, 0: not busy), its reason and limit (0: the launcher's default)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.block = 0
        self.blocks = 0
        self.reason = ""
        self.limit_seconds = 0.0


_BUSY = _Busy()
_ACTIVE: ProgressHeartbeat | None = None  # the running heartbeat of this process, if any


@contextlib.contextmanager
def busy(reason: str, *, limit_seconds: float | None = None) -> Iterator[None]:
    """While entered, this rank is working, not hung: the launcher's hang watch (`--hang-timeout`) does not
    stop it for staying behind the others' collectives, e.g. rank 0 writing the training state while the
    other ranks wait for it in a barrier.

    For at most `limit_seconds` (default: BUSY_LIMIT_FACTOR times the hang timeout), so a rank stuck inside
    (a dead file system) is still caught: past the limit the hang timeout runs as usual, and the summary says
    what it was busy with. The end of a block counts as progress. Nested blocks count as the outermost one.
    Costs nothing without a hang watch (no launcher, or no `--hang-timeout`).

        with busy("saving the training state"):
            write_everything()
    """
    if not isinstance(reason, str):
        raise TypeError(f"reason: expected a str, got {type(reason).__name__}")
    if limit_seconds is not None:
        check_number(limit_seconds, "limit_seconds", positive=True)
    with _BUSY.lock:
        _BUSY.depth += 1
        outermost = _BUSY.depth == 1
        if outermost:
            _BUSY.blocks += 1
            _BUSY.block = _BUSY.blocks
            _BUSY.reason = " ".join(reason.split())  # one line, no tabs: it travels in a space-separated value
            _BUSY.limit_seconds = float(limit_seconds or 0.0)
    if outermost:
        publish_now()
    try:
        yield
    finally:
        with _BUSY.lock:
            _BUSY.depth -= 1
            ended = _BUSY.depth == 0
            if ended:
                _BUSY.block, _BUSY.reason, _BUSY.limit_seconds = 0, "", 0.0
        if ended:
            publish_now()


def publish_now() -> None:
    """Tell the launcher at once (from the calling thread), so that the heartbeat's thread, however late it
    runs, cannot leave the launcher a stale picture (a busy block, or a collective the others may not join, which
    the launcher then knows of even if the backend aborts the process); nothing without a hang watch."""
    heartbeat = _ACTIVE
    if heartbeat is not None:
        with contextlib.suppress(Exception):  # the store went away: the run is ending
            heartbeat.publish()


def publish_soon() -> None:
    """Ask the heartbeat's thread to publish now (a step's first collective: the launcher's picture stays one
    step fresh at the cost of waking a thread, not of a store round trip in the step); nothing without one."""
    heartbeat = _ACTIVE
    if heartbeat is not None:
        heartbeat.wake.set()


def heartbeat_value(
    count: int,
    pid: int,
    node: str | int,
    block: int = 0,
    limit: float = 0.0,
    reason: str = "",
    collective: dict | None = None,
) -> str:
    """What a rank publishes: `count pid node block limit reason` (block 0: not busy; limit 0: the default), then
    on a second line its last recorded collective as JSON, where it has one."""
    value = f"{count} {pid} {node} {block} {limit!r} {reason}"
    return value if collective is None else value + "\n" + json.dumps(collective)


def parse_collective(value: str) -> dict | None:
    """The last recorded collective a heartbeat value carries (`Collective.as_dict`), None without one."""
    _, newline, rest = value.partition("\n")
    if not newline:
        return None
    try:
        found = json.loads(rest)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


# (count, pid, node, busy block, busy limit, reason)
Heartbeat = tuple[int, int, int, int, float, str]


def parse_heartbeat(value: str) -> Heartbeat:
    """(count, pid, node, busy block, busy limit, reason) from `heartbeat_value` (a bare `count pid node` too)."""
    fields = value.partition("\n")[0].split(" ", 5)
    count, pid, node = int(fields[0]), int(fields[1]), int(fields[2])
    if len(fields) < 6:
        return count, pid, node, 0, 0.0, ""
    limit = float(fields[4])
    return count, pid, node, int(fields[3]), limit if math.isfinite(limit) else 0.0, fields[5]


class ProgressHeartbeat:
    """A worker's side of the hang watch: publishes (collectives issued, pid, node, busy state) to the
    launcher's store.

    The count comes from the process group's own sequence number, so it moves exactly when this rank
    issues a collective; a rank stuck anywhere (Python loop, sleep, C code) leaves it where it is, unless it
    said it is `busy`.
    """

    def __init__(self, rank: int, interval_seconds: float):
        import torch.distributed as dist

        self.rank = rank
        self.interval_seconds = interval_seconds
        self.attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.node = os.environ.get("GROUP_RANK", "0")
        self.group = dist.distributed_c10d._get_default_group()
        self.store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=10),
        )
        folder = os.environ.get(STACKS_DIR_VARIABLE)
        self.collective_path = collective_file(folder, rank) if folder and os.path.isdir(folder) else None
        self._publish_lock = threading.Lock()  # a value read and written as one: no older one lands last
        self._done = False
        self._stop = threading.Event()
        self.wake = threading.Event()  # publish before the interval is up (publish_soon)
        self._thread = threading.Thread(target=self._run, name="dpkit-heartbeat", daemon=True)

    def start(self) -> ProgressHeartbeat:
        global _ACTIVE
        self.publish()
        self._thread.start()
        _ACTIVE = self
        return self

    def publish(self, done: bool = False) -> None:
        with self._publish_lock:
            if self._done:
                return
            self._done = done
            # a pybind method of ProcessGroup that torch's stubs leave out
            count = -1 if done else self.group._get_sequence_number_for_group()  # type: ignore[attr-defined]
            with _BUSY.lock:
                block, limit, reason = _BUSY.block, _BUSY.limit_seconds, _BUSY.reason
            # imported here: `dpkit.launch` is imported by every launched worker before the user's script, and
            # the record's module loads torch (a heartbeat only runs once a process group, hence torch, exists)
            from dpkit.observe.collectives import RECORD

            last = RECORD.last()
            value = heartbeat_value(
                count, os.getpid(), self.node, block, limit, reason, None if last is None else last.as_dict()
            )
            self.store.set(heartbeat_key(self.attempt, self.rank), value)
            if last is not None and self.collective_path is not None:
                with open(self.collective_path, "w") as handle:  # for the launcher, should this process die
                    json.dump(last.as_dict(), handle)

    def _run(self) -> None:
        while True:
            self.wake.wait(self.interval_seconds)
            self.wake.clear()
            if self._stop.is_set():
                return
            try:
                self.publish()
            except Exception:  # the store went away: the launcher is gone or the run is ending
                return

    def stop(self) -> None:
        """Mark this rank finished (the watch stops looking at it) and end the thread."""
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        self._stop.set()
        self.wake.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self.publish(done=True)
