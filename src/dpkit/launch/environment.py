"""What a launcher tells its workers through the environment, shared by the agent side and the worker side."""

from __future__ import annotations

import os
from dataclasses import dataclass

# set by torchrun for every worker
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# set by dpkit's launcher for its workers: its pid (the parent-death check) and the hang timeout
LAUNCHER_PID_VARIABLE = "DPKIT_LAUNCHER_PID"
HANG_TIMEOUT_VARIABLE = "DPKIT_HANG_TIMEOUT_SECONDS"
# set for the workers of a command that started itself again once per device (launch/relaunch.py)
RELAUNCHED_VARIABLE = "DPKIT_RELAUNCHED"
# where each worker's progress waits in the rendezvous store for the launcher's hang watch
HEARTBEAT_PREFIX = "dpkit/heartbeat"
# set by dpkit's launcher: the folder where each worker writes its Python stacks (a fatal signal, or the
# launcher's STACK_SIGNAL when it reports a hang), one file per rank (stack_file)
STACKS_DIR_VARIABLE = "DPKIT_STACKS_DIR"


def launched() -> bool:
    """Whether this process was started by a launcher (dpkit launch / torchrun)."""
    return all(name in os.environ for name in LAUNCH_VARIABLES)


@dataclass(frozen=True)
class ProcessPlace:
    """Where this process sits in its launched group: the only reading of the launch variables."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int | None = 1  # None: the launcher did not say (torchrun always does)
    node_rank: int = 0

    @property
    def is_first(self) -> bool:
        return self.rank == 0


def process_place() -> ProcessPlace:
    """This process's rank, group size and node from the launcher's variables; rank 0 of 1 when not launched."""
    if not launched():
        return ProcessPlace()
    environ = os.environ
    world_size = int(environ["WORLD_SIZE"])
    local_world_size = int(environ["LOCAL_WORLD_SIZE"]) if environ.get("LOCAL_WORLD_SIZE") else None
    rank = int(environ["RANK"])
    node_rank = int(environ.get("GROUP_RANK", rank // (local_world_size or world_size)))
    return ProcessPlace(rank, world_size, int(environ["LOCAL_RANK"]), local_world_size, node_rank)


def missing_launch_variables() -> list[str]:
    """The launch variables this process lacks (all of them when it was not launched)."""
    return [name for name in LAUNCH_VARIABLES if name not in os.environ]


def hang_timeout_seconds() -> float | None:
    """The launcher's hang timeout for this worker, None when no launcher watches for hangs."""
    value = os.environ.get(HANG_TIMEOUT_VARIABLE)
    return float(value) if value else None


def restart_count() -> int:
    """How many times the launcher restarted this worker group (0 for the first attempt or no launcher)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) if launched() else 0


def stack_file(folder: str, rank: int | str) -> str:
    return os.path.join(folder, f"stacks-rank{rank}.txt")


def collective_file(folder: str, rank: int | str) -> str:
    """Where a worker also keeps its last published collective: the launcher reads it for a rank that died."""
    return os.path.join(folder, f"collective-rank{rank}.json")


def heartbeat_key(attempt: str, rank: int) -> str:
    return f"{HEARTBEAT_PREFIX}/{attempt}/{rank}"
