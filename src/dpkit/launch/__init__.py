"""Start one process per device on one or more nodes, through torch.distributed.run (torchrun).

torchrun's elastic agent does the real work: static rendezvous at master_addr:master_port (node 0's agent
hosts the store), RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT for each worker, and
monitoring: when a worker exits with an error, the agent stops the others on its node and reports the
failure (or restarts the group, up to max_restarts). dpkit adds a free port when none is given, a clear
error when a given port is taken, a fair share of CPU threads per process, a script checked before any worker
starts, nproc_per_node="auto" (every GPU, else 2), each worker's output named by its rank on the console and
kept in files on request (logs.py, on torchrun's DefaultLogsSpecs), the nodes and rendezvous from SLURM's
variables inside an srun step (slurm.py), and a readable failure summary, and guards against faults torchrun
leaves open:

- workers die with their launcher: each worker asks the kernel for SIGKILL when the launcher process
  dies (prctl PR_SET_PDEATHSIG on Linux), so `kill -9` of the launcher leaves no worker behind (torchrun
  starts each worker in a session of its own, out of reach of the terminal and of the launcher's group);
- a rank that stops making progress is named: with hang_timeout_seconds, every ddp worker publishes the
  sequence number of its last collective in the rendezvous store, and the launcher stops a rank that
  has stayed behind the others for that long, naming it (not the ranks that were waiting for it); a rank
  that works alone for long (rank 0 saving the state) says so with `busy(reason)`;
- restarts (max_restarts) never retry what cannot succeed: a worker exiting with 2 (bad input) or 3 (the
  training diverged) ends the launch;
- a worker's rendezvous is bounded and Ctrl-C works while it waits (`rendezvous_store`).

The failure summary names the worker that failed first: torchrun's failure timestamps count whole seconds,
and the agent polls its workers every monitor interval, so a worker that died of another's failure (its
collective lost its peer) can look as early as the culprit; `ExitWatch` notes when each worker exited.
"""

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from dpkit.launch.environment import LAUNCH_VARIABLES, launched, restart_count
from dpkit.launch.failures import LaunchError, StoppedBySignal
from dpkit.launch.heartbeat import busy
from dpkit.launch.network import free_port, loopback_interface, port_in_use
from dpkit.launch.relaunch import Command, relaunch, relaunched

if TYPE_CHECKING:
    from dpkit.launch.agent import launch


def __getattr__(name: str) -> Callable[..., None]:
    """`launch` loads torch's launcher on first use: a worker's first code (dpkit.launch.worker) needs none of it."""
    if name != "launch":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = importlib.import_module(f"{__name__}.agent").launch
    globals()[name] = value
    return value


__all__ = [
    "LAUNCH_VARIABLES",
    "Command",
    "LaunchError",
    "StoppedBySignal",
    "busy",
    "free_port",
    "launch",
    "launched",
    "loopback_interface",
    "port_in_use",
    "relaunch",
    "relaunched",
    "restart_count",
]
