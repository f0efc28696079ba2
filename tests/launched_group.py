"""Worker groups under dpkit's launcher, kept for the whole test session and given one job after another.

Starting a group costs every worker an import of torch and dpkit (seconds each on 2 cores), far more than
most jobs run. So a test that needs N processes asks `groups(N)` (the session fixture in conftest.py) for a
group that is already up, and runs a function of a test module in every process:

    results = groups(2).run(engine_run, "ddp", 2, 64)     # [rank 0's return value, rank 1's]

The function runs as a launched worker runs a script: RANK, WORLD_SIZE and the rendezvous are torchrun's, so
an Engine made there joins the group like one in `dpkit launch train.py`. Each job makes and closes its own
Engine; the processes stay. A job that raises (or a worker that dies) ends the group, and the next `run` starts
a fresh one, so one test's failure never leaves a half-finished collective for the next.

Tests of the launcher itself (restarts, hangs, signals, killed workers) start their own processes instead.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

START_SECONDS = 180  # a worker must call back within this; a safety net, never what a test asserts
JOB_SECONDS = 300  # the suite's per-test timeout: a job past it has hung
STOP_SECONDS = 5  # a clean exit of the workers; then they are killed, since the group holds nothing to keep

WORKER = textwrap.dedent("""
    import importlib, os, pickle, socket, sys, traceback
    from multiprocessing.connection import Connection

    host, port = sys.argv[1], int(sys.argv[2])
    connection = Connection(socket.create_connection((host, port)).detach())
    connection.send_bytes(pickle.dumps(int(os.environ["RANK"])))
    while True:
        job = pickle.loads(connection.recv_bytes())
        if job is None:
            break
        folder, module, name, args, kwargs = job
        if folder not in sys.path:
            sys.path.insert(0, folder)
        try:
            result = ("ok", getattr(importlib.import_module(module), name)(*args, **kwargs))
        except BaseException:
            result = ("error", traceback.format_exc())
        connection.send_bytes(pickle.dumps(result))
        if result[0] == "error":
            break
    # the group holds nothing to keep: skip the interpreter's teardown of torch (a second or more of CPU each)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
""")


class JobFailed(AssertionError):
    pass


class LaunchedGroup:
    """`size` processes started by `dpkit launch`, each waiting for jobs on a socket of this process."""

    def __init__(self, size: int, folder: Path):
        self.size = size
        script = folder / "group_worker.py"
        script.write_text(WORKER)
        self.log = folder / "launcher.log"
        server = socket.create_server(("127.0.0.1", 0))
        server.settimeout(1.0)
        command = [sys.executable, "-m", "dpkit.cli.main", "launch", "--nproc-per-node", str(size)]
        with open(self.log, "wb") as log:
            self.launcher = subprocess.Popen(
                [*command, str(script), "127.0.0.1", str(server.getsockname()[1])],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # stop() ends the launcher and its workers together
                # the launcher's temporary folders (its workers' stacks and output) go to the group's folder: a
                # group killed at the end of the session leaves nothing in the machine's /tmp
                env={**os.environ, "TQDM_DISABLE": "1", "TMPDIR": str(folder)},
            )
        connections: dict[int, Connection] = {}
        deadline = time.monotonic() + START_SECONDS
        try:
            while len(connections) < size:
                if self.launcher.poll() is not None or time.monotonic() > deadline:
                    raise JobFailed(f"a group of {size} did not start:\n{self.log_tail()}")
                try:
                    accepted, _ = server.accept()
                except TimeoutError:
                    continue
                accepted.settimeout(None)
                connection = Connection(accepted.detach())
                connections[pickle.loads(connection.recv_bytes())] = connection
        except BaseException:
            self.stop()
            raise
        finally:
            server.close()
        self.connections = [connections[rank] for rank in range(size)]

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    @property
    def alive(self) -> bool:
        return self.launcher.poll() is None

    def run(self, function: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """`function(*args, **kwargs)` in every process; the return values by rank."""
        module = sys.modules[function.__module__]
        job = pickle.dumps((str(Path(module.__file__).parent), module.__name__, function.__name__, args, kwargs))
        for connection in self.connections:
            connection.send_bytes(job)
        results, errors = [], []
        for rank, connection in enumerate(self.connections):
            try:
                if not connection.poll(JOB_SECONDS):
                    raise JobFailed(f"rank {rank} gave no result within {JOB_SECONDS} s")
                status, value = pickle.loads(connection.recv_bytes())
            except (EOFError, OSError) as error:
                status, value = "error", f"rank {rank}'s worker is gone ({error!r})"
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{value}")
                break  # the others may wait in a collective for ever: the group ends below
            results.append(value)
        if errors:
            self.stop()
            raise JobFailed(f"{function.__name__} failed in a group of {self.size}:\n" + "\n".join(errors))
        return results

    def stop(self) -> None:
        """Ask every worker to return, then end whatever is left of the group (nothing in it is kept)."""
        self.ask_to_stop()
        self.wait_stopped()

    def ask_to_stop(self) -> None:
        if self.launcher.poll() is None:
            for connection in getattr(self, "connections", []):
                with contextlib.suppress(OSError):
                    connection.send_bytes(pickle.dumps(None))

    def wait_stopped(self) -> None:
        if self.launcher.poll() is None:
            try:
                self.launcher.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(self.launcher.pid, signal.SIGKILL)
                self.launcher.wait()
        for connection in getattr(self, "connections", []):
            connection.close()


class Groups:
    """One live group per size, started on first use and again after a failure."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.groups: dict[int, LaunchedGroup] = {}
        self.started = 0

    def __call__(self, size: int) -> LaunchedGroup:
        group = self.groups.get(size)
        if group is None or not group.alive:
            self.started += 1
            folder = self.folder / f"group-{size}-{self.started}"
            folder.mkdir()
            group = self.groups[size] = LaunchedGroup(size, folder)
        return group

    def stop(self) -> None:
        for group in self.groups.values():  # every group winds down at once
            group.ask_to_stop()
        for group in self.groups.values():
            group.wait_stopped()
