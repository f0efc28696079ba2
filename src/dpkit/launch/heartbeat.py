"""The worker's side of the hang watch: how far this rank is, published for the launcher."""

from __future__ import annotations

import contextlib
import os
import threading
from datetime import timedelta

from dpkit.launch.environment import heartbeat_key


class ProgressHeartbeat:
    """A worker's side of the hang watch: publishes (collectives issued, pid, node) to the launcher's store.

    The count comes from the process group's own sequence number, so it moves exactly when this rank
    issues a collective; a rank stuck anywhere (Python loop, sleep, C code) leaves it where it is.
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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dpkit-heartbeat", daemon=True)

    def start(self) -> ProgressHeartbeat:
        self._publish()
        self._thread.start()
        return self

    def _publish(self, done: bool = False) -> None:
        count = -1 if done else self.group._get_sequence_number_for_group()
        self.store.set(heartbeat_key(self.attempt, self.rank), f"{count} {os.getpid()} {self.node}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            try:
                self._publish()
            except Exception:  # the store went away: the launcher is gone or the run is ending
                return

    def stop(self) -> None:
        """Mark this rank finished (the watch stops looking at it) and end the thread."""
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self._publish(done=True)
