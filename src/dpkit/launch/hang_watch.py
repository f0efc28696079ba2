"""The launcher's side of the hang watch: a rank that stays behind the others for the hang timeout is
stopped and named (not the ranks that waited for it). A rank inside `busy()` (heartbeat.py) is working, not
hung, for up to its limit. Ranks that wait in different collectives at the same place in their records (one in
engine.close's barrier, one in a step's all-gather) are named and stopped after the hang timeout too.

The report gives every rank's last recorded collective (op, sequence, step, the user's call site: heartbeat.py
publishes it) and, for the ranks on this node, where its Python code is now: the user's frames from the stacks
the worker writes on STACK_SIGNAL (worker.py)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from dpkit.launch.environment import heartbeat_key
from dpkit.launch.heartbeat import BUSY_LIMIT_FACTOR, Heartbeat, parse_collective, parse_heartbeat
from dpkit.launch.stacks import request_stacks

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = logging.getLogger("dpkit")


@dataclass
class _RankProgress:
    count: int
    pid: int
    node: int
    since: float  # monotonic time of its last progress (its count changed, busy), by the launcher's clock
    behind_since: float | None = None  # when another rank first got past this count
    busy_block: int = 0  # the busy() block it is in (0: none), as the rank numbers them
    busy_since: float = 0.0  # when the launcher first saw it in that block
    busy_limit: float = 0.0  # how long that block counts as progress
    busy_reason: str = ""
    moved: float = 0.0  # when its count last changed or a busy block ended (what a report's "for N s" counts from)

    def __post_init__(self) -> None:
        self.moved = self.moved or self.since


class HangWatch:
    """The launcher's side: a rank whose collective count stays below another rank's for hang_timeout
    seconds is the culprit; the launcher on the culprit's node kills it, so the agent ends the group
    (or restarts it, with max_restarts) and the summary names it.

    A rank inside `busy()` makes progress all the while, for at most its limit (by default
    BUSY_LIMIT_FACTOR times the hang timeout), and again when the block ends; times are the launcher's own,
    so the workers' clocks (other hosts) do not matter, nor does a worker too busy to publish on time."""

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int,
        node_rank: int,
        hang_timeout_seconds: float,
        stacks_dir: str | None = None,
    ):
        self.host, self.port, self.world_size, self.node_rank = host, port, world_size, node_rank
        self.hang_timeout_seconds = hang_timeout_seconds
        self.stacks_dir = stacks_dir  # where the workers write their stacks (STACKS_DIR_VARIABLE), if anywhere
        self.hung: dict[int, str] = {}  # rank -> the report naming it ("" for a rank named in another's report)
        self.collectives: dict[int, dict] = {}  # rank -> its last recorded collective, as last published
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dpkit-hang-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _connect(self) -> TCPStore | None:
        import torch.distributed as dist

        while not self._stop.is_set():  # the agent creates the store when it starts; wait for it
            try:
                return dist.TCPStore(
                    self.host, self.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=2)
                )
            except (RuntimeError, TimeoutError):
                self._stop.wait(0.2)
        return None

    def _run(self) -> None:
        store = self._connect()
        if store is None:
            return
        interval = min(1.0, self.hang_timeout_seconds / 4)
        attempt = 0
        progress: dict[int, _RankProgress] = {}
        while not self._stop.wait(interval):
            try:
                if store.check([heartbeat_key(str(attempt + 1), 0)]):  # the agent restarted the group
                    attempt, progress = attempt + 1, {}
                    self.hung.clear()  # what failed the last attempt is history; this summary is about the new one
                    self.collectives.clear()
                values: dict[int, Heartbeat] = {}
                for rank in range(self.world_size):
                    key = heartbeat_key(str(attempt), rank)
                    if store.check([key]):
                        raw = store.get(key).decode()
                        values[rank] = parse_heartbeat(raw)
                        collective = parse_collective(raw)
                        if collective is not None:
                            self.collectives[rank] = collective
            except Exception:  # the agent closed the store: the run is over
                return
            self._check(progress, values, time.monotonic())

    def _check(self, progress: dict[int, _RankProgress], values: dict[int, Heartbeat], now: float) -> None:
        """One look at every rank's heartbeat: (count, pid, node) or (count, pid, node, busy block, busy limit,
        reason), as `parse_heartbeat` reads them."""
        for rank, value in values.items():
            count, pid, node = value[:3]
            block, limit, reason = (*value[3:6], 0, 0.0, "")[:3]
            seen = progress.get(rank)
            if seen is None or seen.pid != pid:
                seen = progress[rank] = _RankProgress(count, pid, node, now)
            elif seen.count != count:
                seen.count, seen.since, seen.moved = count, now, now
            if block != seen.busy_block:
                if seen.busy_block:
                    seen.since = seen.moved = now  # a busy block ended: that is progress
                seen.busy_block, seen.busy_since, seen.busy_reason = block, now, reason
                seen.busy_limit = limit if limit > 0 else BUSY_LIMIT_FACTOR * self.hang_timeout_seconds
            if seen.busy_block:
                seen.since = max(seen.since, min(now, seen.busy_since + seen.busy_limit))
        live = {rank: p for rank, p in progress.items() if p.count >= 0}
        if len(live) < 2:
            return
        if self._check_different_collectives(live, now):
            return
        ahead = max(p.count for p in live.values())
        for rank, p in live.items():
            if p.count >= ahead:
                p.behind_since = None
                continue
            if p.behind_since is None:
                p.behind_since = now
            # the clock runs from when the others got ahead: a slow start is not a hang
            stalled = now - max(p.since, p.behind_since)
            if stalled < self.hang_timeout_seconds or rank in self.hung:
                continue
            waiting = sorted(r for r, q in live.items() if q.count > p.count)
            # the time it really waited: since it last moved, or since the others got ahead, whichever is later
            waited = now - max(p.moved, p.behind_since)
            message = (
                f"worker rank {rank} (pid {p.pid}, node {p.node}) made no progress for {waited:.0f} s "
                f"(hang_timeout_seconds={self.hang_timeout_seconds:g}): it is at collective {p.count} while rank(s) "
                f"{', '.join(map(str, waiting))} waited at collective {ahead}"
            )
            if p.busy_block:
                message += (
                    f"; it has been busy ({p.busy_reason or 'no reason given'}) for {now - p.busy_since:.0f} s, "
                    f"past the {p.busy_limit:g} s a busy block counts as progress"
                )
            message += self._where_ranks_are(live)
            self.hung[rank] = message + ("; it was stopped" if p.node == self.node_rank else "")
            log.warning("launch: %s", message)
            if p.node == self.node_rank:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)

    def _check_different_collectives(self, live: dict[int, _RankProgress], now: float) -> bool:
        """Ranks at the same place in their records (the same sequence number) but in different collectives, none
        of them moving for the hang timeout, wait for each other for ever: name them all, stop this node's."""
        by_sequence: dict[int, list[int]] = {}
        for rank in live:
            entry = self.collectives.get(rank)
            if entry is not None:
                by_sequence.setdefault(int(entry.get("sequence", -1)), []).append(rank)
        for ranks in by_sequence.values():
            ops = {self.collectives[r].get("op") for r in ranks}
            if len(ranks) < 2 or len(ops) < 2 or any(r in self.hung for r in ranks):
                continue
            stalled = min(now - live[r].since for r in ranks)
            if stalled < self.hang_timeout_seconds:
                continue
            waited = min(now - live[r].moved for r in ranks)  # the time they really waited (busy blocks included)
            names = ", ".join(f"rank {r} in {describe_collective(self.collectives[r])}" for r in sorted(ranks))
            message = (
                f"worker ranks {', '.join(map(str, sorted(ranks)))} wait in different collectives at the same place "
                f"of their records, for {waited:.0f} s (hang_timeout_seconds={self.hang_timeout_seconds:g}): "
                f"{names}; a rank ran out of batches or skipped a collective the others made"
            )
            message += self._where_ranks_are(live, with_collectives=False)
            local = [r for r in ranks if live[r].node == self.node_rank]
            self.hung[min(ranks)] = message + (f"; rank(s) {', '.join(map(str, local))} stopped" if local else "")
            for r in ranks:
                self.hung.setdefault(r, "")
            log.warning("launch: %s", message)
            for r in local:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(live[r].pid, signal.SIGKILL)
            return True
        return False

    def _where_ranks_are(self, live: dict[int, _RankProgress], with_collectives: bool = True) -> str:
        """`; last collectives: rank 0: …; now: rank 1 at train.py:12 in main …` for the report."""
        text = ""
        if with_collectives and self.collectives:
            text += "; last collectives: " + "; ".join(
                f"rank {r}: {describe_collective(self.collectives[r])}" for r in sorted(self.collectives) if r in live
            )
        if self.stacks_dir is not None:
            local = {r: p.pid for r, p in live.items() if p.node == self.node_rank}
            stacks = request_stacks(self.stacks_dir, local)
            if stacks:
                text += "; now: " + "; ".join(f"rank {r} at {where}" for r, where in sorted(stacks.items()))
        return text


def describe_collective(entry: dict) -> str:
    """`all_reduce of gradient bucket 0 (collective 12, step 3, train.py:31 in main)` from a published entry."""
    size = int(entry.get("size_bytes", 0) or 0)
    size_text = f" of {size} B" if size and " of " not in str(entry.get("op", "")) else ""
    return (
        f"{entry.get('op', '?')}{size_text} (collective {entry.get('sequence', '?')}, step {entry.get('step', '?')}, "
        f"{entry.get('site', '?')})"
    )
