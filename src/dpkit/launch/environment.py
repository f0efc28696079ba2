"""What a launcher tells its workers through the environment, shared by the agent side and the worker side."""

from __future__ import annotations

import os

# set by torchrun for every worker
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# set by dpkit's launcher for its workers: its pid (the parent-death check) and the hang timeout
LAUNCHER_PID_VARIABLE = "DPKIT_LAUNCHER_PID"
HANG_TIMEOUT_VARIABLE = "DPKIT_HANG_TIMEOUT_SECONDS"
# set for the workers of a command that started itself again once per device (launch/relaunch.py)
RELAUNCHED_VARIABLE = "DPKIT_RELAUNCHED"
# where each worker's progress waits in the rendezvous store for the launcher's hang watch
HEARTBEAT_PREFIX = "dpkit/heartbeat"


def launched() -> bool:
    """Whether this process was started by a launcher (dpkit launch / torchrun)."""
    return all(name in os.environ for name in LAUNCH_VARIABLES)


def restart_count() -> int:
    """How many times the launcher restarted this worker group (0 for the first attempt or no launcher)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) if launched() else 0


def heartbeat_key(attempt: str, rank: int) -> str:
    return f"{HEARTBEAT_PREFIX}/{attempt}/{rank}"
