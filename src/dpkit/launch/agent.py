"""The launcher's side: `launch()` runs a script once per device through torch's launcher API.

The launch is torch's own: a `LaunchConfig` (a static rendezvous at node 0's address, spawned workers, the
output through dpkit.launch.logs) run by `elastic_launch`, torchrun's agent underneath. dpkit adds what
torchrun lacks: the checks before anything starts, the restart policy below, the hang watch, the summary of a
failure (which worker failed first, memory kills, the last collectives, stacks) and the workers' output.

Restarts never retry what cannot succeed. torchrun's agent (SimpleElasticAgent._invoke_run) restarts the
group whenever `_monitor_workers` reports it FAILED and `_remaining_restarts > 0`, whatever the failure. A
worker that exits with 2 (bad input) or 3 (the training diverged) would fail the same way again, so dpkit's
agent, a LocalElasticAgent whose `_monitor_workers` sets the restarts left to 0 for such a failure
(`deterministic_failure`), sends the agent down its own no-restarts path: stop the group, return the failure.
Nothing of torch's loop is copied; torchrun's `launch_agent` builds the agent by the name LocalElasticAgent
in torch.distributed.launcher.api, which `_dpkit_agent` points at dpkit's class for the length of a launch.
Each node's agent decides from its own workers: under ddp every rank stops at the same step with the same
code (the recipe agrees on a diverged loss in a collective), so every node ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpkit.checks import check_int, check_number, check_output_folder
from dpkit.devices import check_process_count, cpu_threads_per_device, resolve_devices
from dpkit.launch.environment import HANG_TIMEOUT_VARIABLE, LAUNCHER_PID_VARIABLE, STACKS_DIR_VARIABLE
from dpkit.launch.failures import (
    ExitWatch,
    LaunchError,
    StoppedBySignal,
    deterministic_failure,
    failure_summary,
    oom_kills,
)
from dpkit.launch.hang_watch import HangWatch
from dpkit.launch.logs import WorkerOutput
from dpkit.launch.network import free_port, is_loopback, loopback_interface, port_in_use
from dpkit.launch.slurm import from_slurm, slurm_gpus_on_node
from dpkit.launch.stacks import fatal_stack, last_collectives
from dpkit.launch.worker import check_script

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from torch.distributed.launcher.api import LaunchConfig

log = logging.getLogger("dpkit")


@contextlib.contextmanager
def _launcher_state(
    threads_per_process: int, master_addr: str, worker_env: dict[str, str] | None = None
) -> Iterator[None]:
    """Environment for the workers, and this process restored afterwards: torchrun's agent sets
    OMP_NUM_THREADS and signal handlers here."""
    worker_env = worker_env or {}
    names = ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", *worker_env)
    saved_env = {name: os.environ.get(name) for name in names}
    os.environ.update(worker_env)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process))
    interface = loopback_interface() if is_loopback(master_addr) else None
    if interface:
        # a loopback rendezvous means one host: keep gloo's connections on loopback too (by default gloo
        # uses the address the hostname resolves to)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    in_main = threading.current_thread() is threading.main_thread()
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved_handlers = {
        name: signal.getsignal(getattr(signal, name)) for name in names if in_main and hasattr(signal, name)
    }
    try:
        yield
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for name, handler in saved_handlers.items():
            signal.signal(getattr(signal, name), handler)


# torchrun's run id (TORCHELASTIC_RUN_ID): the agents' keys in the rendezvous store, and the log folder's name
RUN_ID = "dpkit"
# how long node 0's agent waits for every node to join the static rendezvous (torchrun's default)
RENDEZVOUS_TIMEOUT_SECONDS = 900


def processes_per_node(nproc_per_node: int | str) -> int:
    """nproc_per_node as a count: 'auto' is every visible GPU, else 2 (CPU processes), as `devices="auto"` is."""
    if nproc_per_node == "auto":
        return len(resolve_devices("auto", "auto"))
    if isinstance(nproc_per_node, (str, bool)) or not isinstance(nproc_per_node, int):
        raise ValueError(
            f"nproc_per_node: expected a positive int or 'auto' (every GPU, else 2), got {nproc_per_node!r}"
        )
    check_int(nproc_per_node, "nproc_per_node")
    return nproc_per_node


@dataclass(frozen=True)
class Meeting:
    """Where this node's workers meet the others: torch's static rendezvous at node 0's address."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int


def launch(
    script: str,
    script_args: Sequence[str] = (),
    *,
    nproc_per_node: int | str = 1,
    nnodes: int | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    max_restarts: int = 0,
    module: bool = False,
    monitor_interval_seconds: float = 0.1,
    hang_timeout_seconds: float | None = None,
    force: bool = False,
    worker_environment: dict[str, str] | None = None,
    log_dir: str | os.PathLike | None = None,
    rank_prefix: bool | None = None,
    show_ranks: Iterable[int] | None = None,
    slurm: bool = False,
) -> None:
    """Run `python script args…` (or `python -m script args…` with module=True) once per process.

    Returns when every worker has exited with 0; raises LaunchError naming the first failed worker (or
    the rank that stopped making progress for hang_timeout_seconds), StoppedBySignal when SIGTERM stopped
    the launcher, and KeyboardInterrupt on SIGINT (Ctrl-C), after the workers were stopped. With
    max_restarts the group is restarted after a failure, except one a restart would only repeat: a worker
    exiting with 2 (bad input) or 3 (training diverged) ends the launch, and LaunchError.exit_code is that
    code (else 1, a failure). More than PROCESSES_PER_CORE processes per core are refused unless force=True.

    nproc_per_node: a count, or 'auto' (every visible GPU, else 2). nnodes and node_rank default to 1 and 0;
    with slurm=True, inside a SLURM job they come from SLURM, and on several nodes master_addr and master_port
    too (`dpkit.launch.slurm.from_slurm`; given values win, and one contradicting an srun step is refused).
    `worker_environment`: variables set for the workers only. Output: `rank_prefix` puts `[rankN]: ` before
    each line of a worker's output on the console (None: when there is more than one process in all),
    `log_dir` keeps each worker's stdout and stderr in files there, `show_ranks` shows only these global ranks'
    output on the console (dpkit.launch.logs). Every argument and the script are checked before a worker starts.
    """
    requested = nproc_per_node
    nproc_per_node = processes_per_node(nproc_per_node)
    check_process_count(nproc_per_node, argument="nproc_per_node", force=force)
    if hang_timeout_seconds is not None:
        check_number(hang_timeout_seconds, "hang_timeout_seconds", positive=True)
    check_int(max_restarts, "max_restarts", minimum=0)
    meeting = _meeting(requested, nproc_per_node, nnodes, node_rank, master_addr, master_port, slurm)
    output = WorkerOutput(
        world_size=meeting.nnodes * nproc_per_node, log_dir=log_dir, rank_prefix=rank_prefix, show_ranks=show_ranks
    )
    check_script(script, module)
    if log_dir is not None:
        check_output_folder(log_dir, "log_dir")
    log.info(
        "launch: %d process(es)%s on node %d of %d, rendezvous at %s:%d",
        nproc_per_node,
        " (auto: " + (f"{nproc_per_node} GPU(s))" if _cuda_visible() else "no GPU visible)")
        if requested == "auto"
        else "",
        meeting.node_rank,
        meeting.nnodes,
        meeting.master_addr,
        meeting.master_port,
    )
    # each worker writes its Python stacks there on a fatal signal or when the hang watch asks (worker.py)
    stacks_dir = tempfile.mkdtemp(prefix="dpkit-stacks-")
    worker_env = {
        **(worker_environment or {}),
        LAUNCHER_PID_VARIABLE: str(os.getpid()),
        STACKS_DIR_VARIABLE: stacks_dir,
    }
    if hang_timeout_seconds is not None:
        worker_env[HANG_TIMEOUT_VARIABLE] = repr(float(hang_timeout_seconds))
    # every worker starts in run_worker (parent-death signal first), which then runs the script
    entry_args = ["-u", "-c", "from dpkit.launch.worker import run_worker; run_worker()"]
    entry_args += ["module" if module else "script", script, *script_args]
    with (
        _launcher_state(cpu_threads_per_device(nproc_per_node), meeting.master_addr, worker_env),
        _quiet_torch_elastic(),
        output,
    ):
        config = _launch_config(meeting, nproc_per_node, max_restarts, monitor_interval_seconds, output)
        watch = None
        if hang_timeout_seconds is not None:
            watch = HangWatch(
                meeting.master_addr,
                meeting.master_port,
                meeting.nnodes * nproc_per_node,
                meeting.node_rank,
                float(hang_timeout_seconds),
                stacks_dir=stacks_dir,
            )
            watch.start()
        try:
            _run_agent(config, entry_args, nproc_per_node, watch, output, stacks_dir)
        finally:
            if watch is not None:
                watch.stop()
            shutil.rmtree(stacks_dir, ignore_errors=True)


def _meeting(
    requested: int | str,
    nproc_per_node: int,
    nnodes: int | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    slurm: bool,
) -> Meeting:
    """The nodes, this node's rank and the rendezvous address, from the arguments (and SLURM's job), checked."""
    if nnodes is not None:
        check_int(nnodes, "nnodes")
    if slurm:
        found = from_slurm(nnodes=nnodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port)
        if found is not None:
            nnodes, node_rank = found.nnodes, found.node_rank
            master_addr, master_port = found.master_addr, found.master_port
            if found.taken:
                log.info("launch: from SLURM job %s: %s", found.job_id, "; ".join(found.taken))
            gpus = slurm_gpus_on_node()
            if requested == "auto" and gpus and not _cuda_visible():
                log.warning(
                    "launch: SLURM gave this node %d GPU(s) (SLURM_GPUS_ON_NODE) but torch sees none "
                    "(torch.cuda.is_available() is False): nproc_per_node='auto' starts %d CPU processes",
                    gpus,
                    nproc_per_node,
                )
    nnodes = 1 if nnodes is None else nnodes
    node_rank = 0 if node_rank is None else node_rank
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank: expected 0 … {nnodes - 1} for nnodes={nnodes}, got {node_rank!r}")
    if nnodes > 1 and (master_addr is None or master_port is None):
        raise ValueError(
            "master_addr/master_port: required when nnodes > 1, so every node meets node 0 at the same address, "
            "e.g. master_addr=10.0.0.1 master_port=29500"
        )
    master_addr = master_addr or "127.0.0.1"
    if master_port is None:
        master_port = free_port(master_addr)
    else:
        check_int(master_port, "master_port")
        if master_port > 65535:
            raise ValueError(f"master_port: {master_port} is not a TCP port (1 … 65535)")
        if node_rank == 0 and port_in_use(master_addr, master_port):
            raise ValueError(
                f"master_port: port {master_port} on {master_addr} is already in use; pick another port, "
                "or leave the port out on a single node and dpkit picks a free one"
            )
    return Meeting(nnodes, node_rank, master_addr, master_port)


def _launch_config(
    meeting: Meeting, nproc_per_node: int, max_restarts: int, monitor_interval_seconds: float, output: WorkerOutput
) -> LaunchConfig:
    """torch's LaunchConfig for torchrun's agent: a static rendezvous of `meeting.nnodes` nodes at node 0's
    address (its TCP store), the workers' output through `output`, spawned processes."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=meeting.nnodes,
        max_nodes=meeting.nnodes,
        nproc_per_node=nproc_per_node,
        run_id=RUN_ID,
        rdzv_endpoint=f"{meeting.master_addr}:{meeting.master_port}",
        rdzv_backend="static",
        rdzv_configs={"rank": meeting.node_rank, "timeout": RENDEZVOUS_TIMEOUT_SECONDS},
        max_restarts=max_restarts,
        monitor_interval=monitor_interval_seconds,
        start_method="spawn",
        logs_specs=output.logs_specs(),
    )


def _run_agent(
    config: LaunchConfig,
    entry_args: list[str],
    nproc_per_node: int,
    watch: HangWatch | None,
    output: WorkerOutput,
    stacks_dir: str,
) -> None:
    """Run the workers through torch's launcher API with dpkit's agent; a failure becomes LaunchError (its
    summary: the first worker that failed, a hang, memory kills, the last collectives), a signal StoppedBySignal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    exits = ExitWatch(nproc_per_node)
    exits.start()
    oom_kills_before = oom_kills()
    not_retried: list[int] = []  # the exit code of a failure the agent did not restart for
    try:
        with _dpkit_agent(not_retried):
            elastic_launch(config=config, entrypoint=sys.executable)(*entry_args)
    except ChildFailedError as error:
        failures = getattr(error, "failures", {}) or {}
        exits.stop()
        hung = watch.hung if watch else None
        oom_kills_after = oom_kills()
        summary = failure_summary(
            error,
            hung,
            exits.exit_times,
            not_retried=bool(not_retried),
            output_note=output.where([*failures, *(hung or {})]),
            oom_kills_during=None
            if oom_kills_before is None or oom_kills_after is None
            else oom_kills_after - oom_kills_before,
            collectives={**(watch.collectives if watch else {}), **last_collectives(stacks_dir, list(failures))},
            fatal_stacks={rank: stack for rank in failures if (stack := fatal_stack(stacks_dir, rank)) is not None},
        )
        code = None if hung else deterministic_failure(failures, exits.exit_times)
        exit_codes = {rank: failure.exitcode for rank, failure in failures.items()}
        raise LaunchError(summary, exit_codes, exit_code=code or 1) from None
    except SignalException as error:
        if error.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise StoppedBySignal(
            f"stopped by {signal.Signals(error.sigval).name}; the workers were stopped", int(error.sigval)
        ) from None
    finally:
        exits.stop()


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


_agent_state = threading.local()  # the launch in this thread: its `not_retried` list (the agent runs in it)
_agent_lock = threading.Lock()
_agent_users = 0  # launches under way in this process; the first installs dpkit's agent, the last takes it out
_agent_saved: type[LocalElasticAgent] | None = None
_agent_cls: type[LocalElasticAgent] | None = None


def _agent_class() -> type[LocalElasticAgent]:
    """torchrun's LocalElasticAgent, except that a failure a restart would only repeat (exit 2 or 3,
    `deterministic_failure`) is not retried; its code goes to the launching thread's `not_retried` list."""
    global _agent_cls
    if _agent_cls is not None:
        return _agent_cls
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class NoPointlessRestartAgent(LocalElasticAgent):
        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED and self._remaining_restarts > 0:
                code = deterministic_failure(result.failures)
                if code is not None:
                    # _invoke_run restarts only while restarts are left: without, it stops the group and returns
                    self._remaining_restarts = 0
                    getattr(_agent_state, "not_retried", []).append(code)
                    log.debug("launch: a worker exited with %d; not restarting the group", code)
                else:  # said before the survivors' own errors and the restarted group's first lines
                    spec = self._worker_group.spec
                    restart = spec.max_restarts - self._remaining_restarts + 1
                    log.warning(
                        "launch: %s; restart %d of %d", _first_failure(result.failures), restart, spec.max_restarts
                    )
            return result

    _agent_cls = NoPointlessRestartAgent
    return _agent_cls


def _first_failure(failures: Mapping[int, ProcessFailure]) -> str:
    """'worker rank R exited with code C' (or 'was killed by SIGNAL') for the failed worker that ended first; the
    workers the agent stopped (SIGTERM) are named only when nothing else failed."""

    def order(item: tuple[int, ProcessFailure]) -> tuple[bool, int, int]:
        rank, failure = item
        return (failure.exitcode == -signal.SIGTERM, failure.timestamp, rank)

    rank, failure = min(failures.items(), key=order)
    code = failure.exitcode
    if code is not None and code < 0:
        try:
            return f"worker rank {rank} was killed by {signal.Signals(-code).name}"
        except ValueError:  # a number with no name here
            return f"worker rank {rank} was killed by signal {-code}"
    return f"worker rank {rank} exited with code {code}"


@contextlib.contextmanager
def _dpkit_agent(not_retried: list[int]) -> Iterator[None]:
    """Make torchrun's launch_agent build dpkit's agent (`_agent_class`) for the length of the block; the
    codes of failures it did not retry are appended to `not_retried`."""
    global _agent_users, _agent_saved
    import torch.distributed.launcher.api as launcher_api

    with _agent_lock:
        if _agent_users == 0:
            _agent_saved = launcher_api.LocalElasticAgent
            # torchrun's launch_agent has no parameter for the agent's class: the module's name is the seam
            launcher_api.LocalElasticAgent = _agent_class()  # type: ignore[misc]
        _agent_users += 1
    _agent_state.not_retried = not_retried
    try:
        yield
    finally:
        _agent_state.not_retried = []
        with _agent_lock:
            _agent_users -= 1
            if _agent_users == 0 and _agent_saved is not None:
                launcher_api.LocalElasticAgent = _agent_saved  # type: ignore[misc]


@contextlib.contextmanager
def _quiet_torch_elastic() -> Iterator[None]:
    """torchrun's agent logs each step of a shutdown as warnings; dpkit's summary says what matters, so
    they show only with dpkit's DEBUG logging (-v). Each of its modules' loggers has its own level."""
    if log.isEnabledFor(logging.DEBUG):
        yield
        return
    # the agent's modules make their loggers when imported: import them first, so that every one is quieted
    import torch.distributed.elastic.multiprocessing.errors
    import torch.distributed.launcher.api  # noqa: F401

    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher")
    ]
    saved = [(logger, logger.level) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)
