"""Start one process per device on one or more nodes, through torch.distributed.run (torchrun).

torchrun's elastic agent does the real work: static rendezvous at master_addr:master_port (node 0's agent
hosts the store), RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT for each worker, and
monitoring: when a worker exits with an error, the agent stops the others on its node and reports the
failure (or restarts the group, up to max_restarts). dpkit adds a free port when none is given, a clear
error when a given port is taken, a fair share of CPU threads per process, and a readable failure
summary, and three guards against faults torchrun leaves open:

- workers die with their launcher: each worker asks the kernel for SIGKILL when the launcher process
  dies (prctl PR_SET_PDEATHSIG on Linux), so `kill -9` of the launcher leaves no worker behind (torchrun
  starts each worker in a session of its own, out of reach of the terminal and of the launcher's group);
- a rank that stops making progress is named: with hang_timeout_seconds, every ddp worker publishes the
  sequence number of its last collective in the rendezvous store, and the launcher stops a rank that
  has stayed behind the others for that long, naming it (not the ranks that were waiting for it);
- a worker's rendezvous is bounded and Ctrl-C works while it waits (`rendezvous_store`).

The failure summary names the worker that failed first: torchrun's failure timestamps count whole seconds,
and the agent polls its workers every monitor interval, so a worker that died of another's failure (its
collective lost its peer) can look as early as the culprit; `ExitWatch` notes when each worker exited.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import logging
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Sequence

from dpkit.arguments import check_int
from dpkit.devices import check_process_count, cpu_threads_per_device
from dpkit.errors import DpkitError

log = logging.getLogger("dpkit")


class LaunchError(DpkitError):
    """A worker process failed; the message names its rank, exit code and error. `exit_codes` maps each
    failed worker's rank to its exit code (negative: killed by that signal)."""

    def __init__(self, message: str, exit_codes: "dict[int, int] | None" = None):
        super().__init__(message)
        self.exit_codes = dict(exit_codes or {})


class StoppedBySignal(DpkitError):
    """The run was stopped by SIGINT or SIGTERM; `exit_code` is 128 + the signal number, as a shell reports it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# set by the launcher for its workers: its pid (the parent-death check) and the hang timeout
LAUNCHER_PID_VARIABLE = "DPKIT_LAUNCHER_PID"
HANG_TIMEOUT_VARIABLE = "DPKIT_HANG_TIMEOUT_SECONDS"
HEARTBEAT_PREFIX = "dpkit/heartbeat"


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
    return check_int(value, name, minimum=minimum)


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
def _launcher_state(threads_per_process: int, master_addr: str, worker_env: "dict[str, str] | None" = None) -> Iterator[None]:
    """Environment for the workers, and this process restored afterwards: torchrun's agent sets
    OMP_NUM_THREADS and signal handlers here."""
    worker_env = worker_env or {}
    names = ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", *worker_env)
    saved_env = {name: os.environ.get(name) for name in names}
    os.environ.update(worker_env)
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


def _failure_order(failures: "dict[int, Any]", exit_times: "dict[int, float] | None" = None) -> list[int]:
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


def _failure_summary(error: BaseException, hung: "dict[int, str] | None" = None,
                     exit_times: "dict[int, float] | None" = None) -> str:
    """The failed workers first, the first to fail first (a rank the hang watch stopped, named with why),
    then the ones the agent stopped (SIGTERM) because of them. `exit_times`: pid -> monotonic exit time."""
    failures = getattr(error, "failures", {}) or {}
    hung = hung or {}
    failed, stopped = [hung[rank] for rank in sorted(hung)], []
    for rank in _failure_order(failures, exit_times):
        failure = failures[rank]
        if rank in hung:
            continue
        if (failure.exitcode is not None and failure.exitcode == -signal.SIGTERM) or hung:
            stopped.append(str(rank))  # with a hung rank found, the others failed because of it
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
        summary += f"; the launcher then stopped worker rank(s) {', '.join(sorted(stopped, key=int))}"
    return summary + " (each worker's own output is above)"


def launch(script: str, script_args: Sequence[str] = (), *, nproc_per_node: int = 1, nnodes: int = 1, node_rank: int = 0,
           master_addr: str | None = None, master_port: int | None = None, max_restarts: int = 0,
           module: bool = False, monitor_interval_seconds: float = 0.1, hang_timeout_seconds: float | None = None,
           force: bool = False) -> None:
    """Run `python script args…` (or `python -m script args…` with module=True) once per process.

    Returns when every worker has exited with 0; raises LaunchError naming the first failed worker (or
    the rank that stopped making progress for hang_timeout_seconds), StoppedBySignal when SIGTERM stopped
    the launcher, and KeyboardInterrupt on SIGINT (Ctrl-C), after the workers were stopped. More than
    PROCESSES_PER_CORE processes per core are refused unless force=True.
    """
    _positive("--nproc-per-node", nproc_per_node)
    check_process_count(nproc_per_node, argument="--nproc-per-node", force=force)
    if hang_timeout_seconds is not None:
        if isinstance(hang_timeout_seconds, bool) or not isinstance(hang_timeout_seconds, (int, float)) or not hang_timeout_seconds > 0 \
                or hang_timeout_seconds == float("inf"):
            raise ValueError(f"--hang-timeout: expected a positive number of seconds, got {hang_timeout_seconds!r}")
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

    from torch.distributed.elastic.multiprocessing.api import SignalException
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
    worker_env = {LAUNCHER_PID_VARIABLE: str(os.getpid())}
    if hang_timeout_seconds is not None:
        worker_env[HANG_TIMEOUT_VARIABLE] = repr(float(hang_timeout_seconds))
    watch = None
    with _launcher_state(cpu_threads_per_device(nproc_per_node), master_addr, worker_env), _quiet_torch_elastic():
        config, _, _ = config_from_args(parse_args(argv))
        # every worker starts in run_worker (parent-death signal first), which then runs the script
        entry_args = ["-u", "-c", "from dpkit.launch import run_worker; run_worker()", "module" if module else "script",
                      script, *script_args]
        if hang_timeout_seconds is not None:
            watch = HangWatch(master_addr, master_port, nnodes * nproc_per_node, node_rank, float(hang_timeout_seconds))
            watch.start()
        exits = ExitWatch(nproc_per_node)
        exits.start()
        try:
            elastic_launch(config=config, entrypoint=sys.executable)(*entry_args)
        except ChildFailedError as error:
            exit_codes = {rank: failure.exitcode for rank, failure in (getattr(error, "failures", {}) or {}).items()}
            exits.stop()
            raise LaunchError(_failure_summary(error, watch.hung if watch else None, exits.exit_times), exit_codes) from None
        except SignalException as error:
            if error.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise StoppedBySignal(f"stopped by {signal.Signals(error.sigval).name}; the workers were stopped", int(error.sigval)) from None
        finally:
            exits.stop()
            if watch is not None:
                watch.stop()


@contextlib.contextmanager
def _quiet_torch_elastic() -> Iterator[None]:
    """torchrun's agent logs each step of a shutdown as warnings; dpkit's summary says what matters, so
    they show only with dpkit's DEBUG logging (-v). Each of its modules' loggers has its own level."""
    if log.isEnabledFor(logging.DEBUG):
        yield
        return
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher")]
    saved = [(logger, logger.level) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


# --- which worker exited first --------------------------------------------------------------------------

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
        self._poller: Any = None
        self._wake_read = self._wake_write = -1
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="dpkit-exit-watch", daemon=True)

    @staticmethod
    def available() -> bool:
        return sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and hasattr(select, "poll") \
            and os.path.isdir("/proc/self")

    def start(self) -> "ExitWatch":
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
            self._poller.register(fd, select.POLLIN)

    def _note_exits(self, timeout_ms: "int | None") -> bool:
        """Wait up to timeout_ms (None: for ever) for an exit or stop; returns False once stopped."""
        events = self._poller.poll(timeout_ms)
        now = time.monotonic()
        running = True
        for fd, _ in events:
            if fd == self._wake_read:
                running = False
                continue
            pid = self._watched.pop(fd, None)
            if pid is None:
                continue
            self._poller.unregister(fd)
            os.close(fd)
            self.exit_times.setdefault(pid, now)
        return running

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


# --- workers die with their launcher -----------------------------------------------------------------

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent_pid: int | None = None) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); exit now if it already has.

    Returns whether the request was made (False off Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("launch: prctl(PR_SET_PDEATHSIG) failed (errno %d); this worker may outlive its launcher", ctypes.get_errno())
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the launcher died before the request took effect: nobody will ever wait for us
    return True


def run_worker(argv: Sequence[str] | None = None) -> None:
    """A launched worker's first code: die with the launcher, then run `script args…` or `-m module args…`
    as `python` itself would."""
    mode, target, *args = list(sys.argv[1:] if argv is None else argv)
    launcher_pid = os.environ.get(LAUNCHER_PID_VARIABLE)
    die_with_parent(int(launcher_pid) if launcher_pid else None)
    if mode == "module":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


# --- bounded, interruptible rendezvous -----------------------------------------------------------------

def rendezvous_store(rank: int, world_size: int, *, wait_seconds: float, timeout_seconds: float) -> Any:
    """The store for init_process_group, once every rank has arrived; at most `wait_seconds` of waiting.

    torch's env:// rendezvous blocks in C++ for the whole process-group timeout while a peer is missing,
    deaf to Ctrl-C. Here every wait is short and in Python (so KeyboardInterrupt arrives), and a missing
    peer is named. Under torchrun's agent the agent hosts the store; otherwise rank 0 does, as with env://.
    """
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    deadline = time.monotonic() + wait_seconds
    store = None
    while store is None:
        try:
            store = dist.TCPStore(host, port, is_master=(rank == 0 and not agent_store), wait_for_workers=False,
                                  timeout=timedelta(seconds=1))
        except (RuntimeError, TimeoutError) as error:  # DistStoreError / DistNetworkError: nobody listens yet
            if rank == 0 and not agent_store:
                raise RuntimeError(f"ddp: rank 0 cannot host the rendezvous at {host}:{port} ({error}); "
                                   "pick another MASTER_PORT") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"ddp: rank {rank} found no rendezvous at {host}:{port} after {wait_seconds:g} s; "
                                   "start rank 0 (or launch with `dpkit launch`)") from None
            time.sleep(0.1)
    store.set_timeout(timedelta(seconds=timeout_seconds))
    # keys of an earlier attempt (torchrun restarts the group on the same store) must not be read as this one's
    store = dist.PrefixStore(f"dpkit/attempt_{attempt}", store)
    store.set(f"arrived/{rank}", "1")
    while True:
        missing = [r for r in range(world_size) if not store.check([f"arrived/{r}"])]
        if not missing:
            return store
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"ddp: rank(s) {', '.join(map(str, missing))} of {world_size} did not join the rendezvous at {host}:{port} "
                f"within {wait_seconds:g} s; start every rank (dpkit launch --nproc-per-node N does), or unset "
                f"{', '.join(LAUNCH_VARIABLES)} to run without a launcher"
            )
        time.sleep(0.05)


# --- naming a rank that stopped making progress ----------------------------------------------------------

def _heartbeat_key(attempt: str, rank: int) -> str:
    return f"{HEARTBEAT_PREFIX}/{attempt}/{rank}"


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
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   wait_for_workers=False, timeout=timedelta(seconds=10))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dpkit-heartbeat", daemon=True)

    def start(self) -> "ProgressHeartbeat":
        self._publish()
        self._thread.start()
        return self

    def _publish(self, done: bool = False) -> None:
        count = -1 if done else self.group._get_sequence_number_for_group()
        self.store.set(_heartbeat_key(self.attempt, self.rank), f"{count} {os.getpid()} {self.node}")

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
                return dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=2))
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
                if store.check([_heartbeat_key(str(attempt + 1), 0)]):  # the agent restarted the group
                    attempt, progress = attempt + 1, {}
                    self.hung.clear()  # what failed the last attempt is history; this summary is about the new one
                values = {}
                for rank in range(self.world_size):
                    key = _heartbeat_key(str(attempt), rank)
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
            message = (f"worker rank {rank} (pid {p.pid}, node {p.node}) made no progress for {stalled:.0f} s "
                       f"(--hang-timeout {self.hang_timeout_seconds:g}): it is at collective {p.count} while rank(s) "
                       f"{', '.join(map(str, waiting))} waited at collective {ahead}")
            self.hung[rank] = message + ("; it was stopped" if p.node == self.node_rank else "")
            log.warning("launch: %s", message)
            if p.node == self.node_rank:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
