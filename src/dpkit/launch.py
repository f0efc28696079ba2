"""Start one process per device on one or more nodes, through torch.distributed.run (torchrun).

torchrun's elastic agent does the real work: static rendezvous at master_addr:master_port (node 0's agent
hosts the store), RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT for each worker, and
monitoring: when a worker exits with an error, the agent stops the others on its node and reports the
failure (or restarts the group, up to max_restarts). dpkit adds a free port when none is given, a clear
error when a given port is taken, a fair share of CPU threads per process, and a readable failure
summary.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import signal
import socket
import threading
from typing import Iterator, Sequence

from dpkit.devices import cpu_threads_per_device
from dpkit.errors import DpkitError

log = logging.getLogger("dpkit")


class LaunchError(DpkitError):
    """A worker process failed; the message names its rank, exit code and error."""


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched() -> bool:
    """Whether this process was started by a launcher (dpkit launch / torchrun)."""
    return all(name in os.environ for name in LAUNCH_VARIABLES)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Whether binding host:port fails because something is already there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free for the store
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return True
            raise ValueError(f"--master-addr: cannot bind {host}:{port} ({error}); give an address of this machine, e.g. 127.0.0.1") from error
    return False


def _positive(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def loopback_interface() -> str | None:
    """The name of the loopback network interface ('lo' on Linux, 'lo0' on macOS), if there is one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name in ("lo", "lo0")), None)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _launcher_state(threads_per_process: int, master_addr: str) -> Iterator[None]:
    """Environment for the workers, and this process restored afterwards: torchrun's agent sets
    OMP_NUM_THREADS and signal handlers here."""
    names = ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")
    saved_env = {name: os.environ.get(name) for name in names}
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process))
    if is_loopback(master_addr) and loopback_interface():
        # a loopback rendezvous means one host: keep gloo's connections on loopback too (by default gloo
        # uses the address the hostname resolves to)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    in_main = threading.current_thread() is threading.main_thread()
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved_handlers = {name: signal.getsignal(getattr(signal, name)) for name in names if in_main and hasattr(signal, name)}
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


def _failure_summary(error: BaseException) -> str:
    """The failed workers first, then the ones the agent stopped (SIGTERM) because of them."""
    failures = getattr(error, "failures", {}) or {}
    failed, stopped = [], []
    for rank, failure in sorted(failures.items()):
        if failure.exitcode is not None and failure.exitcode == -signal.SIGTERM:
            stopped.append(str(rank))
            continue
        how = (f"was killed by signal {failure.signal_name()}" if failure.exitcode is not None and failure.exitcode < 0
               else f"exited with code {failure.exitcode}")
        message = failure.message if isinstance(failure.message, str) else (failure.message or {}).get("message", "")
        detail = "" if not message or "elastic/errors.html" in str(message) else str(message).strip().splitlines()[-1]
        failed.append(f"worker rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}" + (f": {detail}" if detail else ""))
    if not failed and not stopped:
        return str(error)
    summary = "; ".join(failed) if failed else "workers were stopped"
    if stopped:
        summary += f"; the launcher then stopped worker rank(s) {', '.join(stopped)}"
    return summary + " (each worker's own output is above)"


def launch(script: str, script_args: Sequence[str] = (), *, nproc_per_node: int = 1, nnodes: int = 1, node_rank: int = 0,
           master_addr: str | None = None, master_port: int | None = None, max_restarts: int = 0,
           module: bool = False, monitor_interval_seconds: float = 0.1) -> None:
    """Run `python script args…` (or `python -m script args…` with module=True) once per process.

    Returns when every worker has exited with 0; raises LaunchError naming the first failed worker.
    """
    _positive("--nproc-per-node", nproc_per_node)
    _positive("--nnodes", nnodes)
    _positive("--max-restarts", max_restarts, minimum=0)
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank: expected 0 … {nnodes - 1} for --nnodes {nnodes}, got {node_rank!r}")
    if nnodes > 1 and (master_addr is None or master_port is None):
        raise ValueError(
            "--master-addr/--master-port: required with --nnodes > 1, so every node meets node 0 at the same address, "
            "e.g. --master-addr 10.0.0.1 --master-port 29500"
        )
    master_addr = master_addr or "127.0.0.1"
    if master_port is None:
        master_port = free_port(master_addr)
    else:
        _positive("--master-port", master_port)
        if master_port > 65535:
            raise ValueError(f"--master-port: {master_port} is not a TCP port (1 … 65535)")
        if node_rank == 0 and port_in_use(master_addr, master_port):
            raise ValueError(
                f"--master-port: port {master_port} on {master_addr} is already in use; pick another port, "
                "or leave --master-port out on a single node and dpkit picks a free one"
            )

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    argv = [
        f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--nproc-per-node={nproc_per_node}",
        f"--master-addr={master_addr}", f"--master-port={master_port}", f"--max-restarts={max_restarts}",
        "--rdzv-backend=static", f"--monitor-interval={monitor_interval_seconds}",
    ]
    if module:
        argv.append("--module")
    argv += [script, *script_args]
    log.info("launch: %d process(es) on node %d of %d, rendezvous at %s:%d", nproc_per_node, node_rank, nnodes, master_addr, master_port)
    with _launcher_state(cpu_threads_per_device(nproc_per_node), master_addr):
        config, entrypoint, entry_args = config_from_args(parse_args(argv))
        try:
            elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
        except ChildFailedError as error:
            raise LaunchError(_failure_summary(error)) from None
