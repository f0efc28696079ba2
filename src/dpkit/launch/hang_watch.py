"""The launcher's side of the hang watch: a rank that stays behind the others for the hang timeout is
stopped and named (not the ranks that waited for it)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from dpkit.launch.environment import heartbeat_key

log = logging.getLogger("dpkit")


@dataclass
class _RankProgress:
    count: int
    pid: int
    node: int
    since: float  # monotonic time the count last changed, by the launcher's clock
    behind_since: float | None = None  # when another rank first got past this count


class HangWatch:
    """The launcher's side: a rank whose collective count stays below another rank's for hang_timeout
    seconds is the culprit; the launcher on the culprit's node kills it, so the agent ends the group
    (or restarts it, with max_restarts) and the summary names it."""

    def __init__(self, host: str, port: int, world_size: int, node_rank: int, hang_timeout_seconds: float):
        self.host, self.port, self.world_size, self.node_rank = host, port, world_size, node_rank
        self.hang_timeout_seconds = hang_timeout_seconds
        self.hung: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dpkit-hang-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _connect(self) -> Any:
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
        attempt, progress = 0, {}
        while not self._stop.wait(interval):
            try:
                if store.check([heartbeat_key(str(attempt + 1), 0)]):  # the agent restarted the group
                    attempt, progress = attempt + 1, {}
                    self.hung.clear()  # what failed the last attempt is history; this summary is about the new one
                values = {}
                for rank in range(self.world_size):
                    key = heartbeat_key(str(attempt), rank)
                    if store.check([key]):
                        count, pid, node = store.get(key).decode().split()
                        values[rank] = (int(count), int(pid), int(node))
            except Exception:  # the agent closed the store: the run is over
                return
            self._check(progress, values, time.monotonic())

    def _check(self, progress: dict[int, _RankProgress], values: dict[int, tuple[int, int, int]], now: float) -> None:
        for rank, (count, pid, node) in values.items():
            seen = progress.get(rank)
            if seen is None or seen.count != count or seen.pid != pid:
                progress[rank] = _RankProgress(count, pid, node, now)
        live = {rank: p for rank, p in progress.items() if p.count >= 0}
        if len(live) < 2:
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
            message = (
                f"worker rank {rank} (pid {p.pid}, node {p.node}) made no progress for {stalled:.0f} s "
                f"(hang_timeout_seconds={self.hang_timeout_seconds:g}): it is at collective {p.count} while rank(s) "
                f"{', '.join(map(str, waiting))} waited at collective {ahead}"
            )
            self.hung[rank] = message + ("; it was stopped" if p.node == self.node_rank else "")
            log.warning("launch: %s", message)
            if p.node == self.node_rank:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
