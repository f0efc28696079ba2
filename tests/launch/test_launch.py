"""The launcher on torch.distributed.run: ports, validation, environment, failures and restarts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from dpkit.launch import LaunchError, free_port, launch, loopback_interface, port_in_use

ENV_SCRIPT = textwrap.dedent("""
    import json, os, sys
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
            "GLOO_SOCKET_IFNAME"]
    out = sys.argv[1]
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as handle:
        json.dump({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[2:]}, handle)
""")


def listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def test_free_port_is_free_and_a_listening_port_is_in_use():
    port = free_port("127.0.0.1")
    assert 0 < port < 65536 and not port_in_use("127.0.0.1", port)
    with listening_socket() as sock:
        assert port_in_use("127.0.0.1", sock.getsockname()[1])


def test_a_taken_port_is_a_clear_error_before_anything_starts(tmp_path):
    with listening_socket() as sock:
        port = sock.getsockname()[1]
        with pytest.raises(ValueError, match=f"master_port: port {port} on 127.0.0.1 is already in use"):
            launch(str(tmp_path / "never_run.py"), nproc_per_node=2, master_port=port)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"nproc_per_node": 0}, "nproc_per_node: expected a positive int, got 0"),
        (
            {"nnodes": 2, "node_rank": 2, "master_addr": "127.0.0.1", "master_port": 29555},
            "node_rank: expected 0 … 1 for nnodes=2",
        ),
        ({"nnodes": 2, "node_rank": 1}, "master_addr/master_port: required when nnodes > 1"),
        ({"max_restarts": -1}, "max_restarts: expected a non-negative int"),
        ({"master_port": 70000}, "not a TCP port"),
    ],
)
def test_invalid_arguments_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch("script.py", **kwargs)


def test_workers_get_ranks_the_rendezvous_and_their_arguments(tmp_path):
    script = tmp_path / "env.py"
    script.write_text(ENV_SCRIPT)
    before = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")}
    launch(str(script), [str(tmp_path), "--flag", "value"], nproc_per_node=2)
    assert {name: os.environ.get(name) for name in before} == before  # the launcher leaves this process as it was
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(seen):
        env = record["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["OMP_NUM_THREADS"] is not None
        if before["GLOO_SOCKET_IFNAME"] is None and loopback_interface():
            assert env["GLOO_SOCKET_IFNAME"] == loopback_interface()  # gloo stays on loopback too
        assert record["argv"] == ["--flag", "value"]
    assert seen[0]["env"]["MASTER_PORT"] == seen[1]["env"]["MASTER_PORT"]


def test_a_failed_worker_is_named_with_its_exit_code(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    with pytest.raises(LaunchError, match=r"worker rank 1 \(local rank 1, pid \d+\) exited with code 3"):
        launch(str(script), nproc_per_node=2)


def test_max_restarts_restarts_the_group_after_a_failure(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, sys
        marker = {str(tmp_path / "failed-once")!r}
        if os.environ["RANK"] == "0" and not os.path.exists(marker):
            open(marker, "w").close()
            sys.exit(5)
        done = {str(tmp_path)!r} + f"/done-{{os.environ['RANK']}}-{{os.environ['TORCHELASTIC_RESTART_COUNT']}}"
        open(done, "w").close()
    """)
    )
    launch(str(script), nproc_per_node=2, max_restarts=1)
    assert (tmp_path / "done-0-1").exists() and (tmp_path / "done-1-1").exists()
    with pytest.raises(LaunchError):
        (tmp_path / "failed-once").unlink()
        launch(str(script), nproc_per_node=2, max_restarts=0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie waiting for a dead parent to reap it counts as gone
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_kill_9_of_the_launcher_leaves_no_worker_behind(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, time
        open({str(tmp_path)!r} + f"/pid-{{os.environ['RANK']}}", "w").write(str(os.getpid()))
        time.sleep(120)
    """)
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dpkit.cli.main", "launch", "--nproc-per-node", "2", str(script)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # a killed launcher cannot remove its temporary folders
    )
    try:
        deadline = time.monotonic() + 60
        while not all(
            (tmp_path / f"pid-{rank}").exists() and (tmp_path / f"pid-{rank}").read_text() for rank in range(2)
        ):
            assert time.monotonic() < deadline and launcher.poll() is None, "the workers never started"
            time.sleep(0.1)
        pids = [int((tmp_path / f"pid-{rank}").read_text()) for rank in range(2)]
        assert all(_alive(pid) for pid in pids)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [pid for pid in pids if _alive(pid)]
    finally:
        launcher.kill()
        for rank in range(2):
            with contextlib.suppress(Exception):
                os.kill(int((tmp_path / f"pid-{rank}").read_text()), signal.SIGKILL)
    assert survivors == [], f"workers {survivors} outlived their launcher"


# a rank that stops making progress (stuck outside any collective) is named within the hang timeout:
# tests/launch/test_collective_faults.py's stuck rank, with the collective and the line where it is


def test_hang_timeout_must_be_positive():
    with pytest.raises(ValueError, match="hang_timeout_seconds: expected a finite number > 0, got 0"):
        launch("script.py", hang_timeout_seconds=0)


def test_too_many_processes_for_the_cores_need_force():
    from dpkit.devices import PROCESSES_PER_CORE, available_cores

    too_many = PROCESSES_PER_CORE * available_cores() + 1
    with pytest.raises(ValueError, match=f"nproc_per_node: {too_many} processes on .* pass force=True"):
        launch("script.py", nproc_per_node=too_many)


NO_PEERS = textwrap.dedent("""
    import sys, time
    import dpkit.strategies.process_group as process_group
    from dpkit.engine.engine import Engine

    def announced_rendezvous(*args, **kwargs):
        print("in the rendezvous", flush=True)  # the test's Ctrl-C comes once this line is out
        return rendezvous(*args, **kwargs)

    rendezvous, process_group.rendezvous_store = process_group.rendezvous_store, announced_rendezvous
    try:
        Engine(strategy="ddp", accelerator="cpu", devices=1, init_timeout_seconds=float(sys.argv[1]))
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
    except RuntimeError as error:
        print("error:", error, flush=True)
        sys.exit(3)
""")


def _no_peer_env() -> dict:
    return {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }


def test_an_engine_without_its_peers_gives_up_after_the_init_timeout(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(NO_PEERS)
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(script), "2"], env=_no_peer_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert "rank(s) 1 of 2 did not join the rendezvous" in result.stdout
    assert time.monotonic() - began < 30


def test_ctrl_c_stops_an_engine_waiting_for_its_peers(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(NO_PEERS)
    process = subprocess.Popen(
        [sys.executable, str(script), "300"], env=_no_peer_env(), stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "in the rendezvous"
    process.send_signal(signal.SIGINT)
    try:
        output, _ = process.communicate(timeout=10)
    finally:
        process.kill()
    assert process.returncode == 130 and "interrupted" in output


def test_the_hang_rule_names_only_a_rank_left_behind_for_the_timeout():
    from dpkit.launch.hang_watch import HangWatch

    watch = HangWatch("127.0.0.1", 1, world_size=3, node_rank=1, hang_timeout_seconds=10)  # node 1: kills nobody here
    progress = {}
    watch._check(progress, {0: (5, 100, 0), 1: (5, 101, 0), 2: (5, 102, 0)}, now=0)
    watch._check(progress, {0: (5, 100, 0), 1: (5, 101, 0), 2: (5, 102, 0)}, now=50)
    assert watch.hung == {}  # all equally busy for 50 s: one long step, nobody to blame
    watch._check(progress, {0: (6, 100, 0), 1: (5, 101, 0), 2: (6, 102, 0)}, now=55)
    watch._check(progress, {0: (6, 100, 0), 1: (5, 101, 0), 2: (6, 102, 0)}, now=64)
    assert watch.hung == {}  # behind for 9 s only: the clock starts when the others got ahead, not at its last change
    watch._check(progress, {0: (6, 100, 0), 1: (5, 101, 0), 2: (6, 102, 0)}, now=66)
    assert list(watch.hung) == [1] and "worker rank 1 (pid 101, node 0) made no progress for 11 s" in watch.hung[1]
    assert "rank(s) 0, 2 waited at collective 6" in watch.hung[1]
    watch._check(
        progress, {0: (-1, 100, 0), 1: (5, 101, 0), 2: (-1, 102, 0)}, now=70
    )  # finished ranks are not compared


def test_a_hang_after_a_busy_block_reports_the_time_the_rank_really_waited():
    """A rank left behind inside busy() (a save after its loop ended, while the others still train) is named once
    the block's allowance is spent; its report says how long it really waited, not the time past the allowance."""
    from dpkit.launch.hang_watch import HangWatch

    watch = HangWatch("127.0.0.1", 1, world_size=2, node_rank=1, hang_timeout_seconds=10)
    progress = {}
    watch._check(progress, {0: (5, 100, 0), 1: (5, 101, 0)}, now=0)
    watch._check(progress, {0: (6, 100, 0), 1: (5, 101, 0, 1, 100.0, "saving")}, now=1)  # busy for up to 100 s
    watch._check(progress, {0: (6, 100, 0), 1: (5, 101, 0, 1, 100.0, "saving")}, now=105)
    assert watch.hung == {}  # 100 s of busy count as progress: 4 s past them
    watch._check(progress, {0: (6, 100, 0), 1: (5, 101, 0, 1, 100.0, "saving")}, now=112)
    assert "worker rank 1 (pid 101, node 0) made no progress for 111 s (hang_timeout_seconds=10)" in watch.hung[1]
    assert "busy (saving) for 111 s, past the 100 s a busy block counts as progress" in watch.hung[1]


def _child_failed(*records, timestamp=1_000):
    """A torchrun ChildFailedError of (rank, pid, exitcode) records, all at the same whole-second timestamp."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {}
    for rank, pid, exitcode in records:
        failures[rank] = ProcessFailure(
            local_rank=rank, pid=pid, exitcode=exitcode, error_file="/nonexistent/error.json"
        )
        failures[rank].timestamp = timestamp
    return ChildFailedError("worker", failures)


def test_the_summary_names_the_worker_that_exited_first_not_the_lowest_rank():
    from dpkit.launch.failures import failure_summary

    # rank 1 crashed (exit 7); rank 0's collective lost its peer and it aborted 40 ms later, in the same
    # whole second and the same agent poll
    error = _child_failed((0, 100, -signal.SIGABRT), (1, 101, 7))
    summary = failure_summary(error, exit_times={101: 5.00, 100: 5.04})
    assert summary.startswith(
        "worker rank 1 (local rank 1, pid 101) exited with code 7; "
        "worker rank 0 (local rank 0, pid 100) was killed by signal SIGABRT"
    ), summary
    # without exit times (or with one missing), the same second: the signal death is the consequence
    assert failure_summary(error).startswith("worker rank 1 ")
    assert failure_summary(error, exit_times={101: 5.0}).startswith("worker rank 1 ")
    # a worker killed first (the OOM killer's SIGKILL) is the culprit, before the peer that errored after it
    error = _child_failed((0, 100, -signal.SIGKILL), (1, 101, 1))
    assert failure_summary(error, exit_times={100: 5.00, 101: 5.30}).startswith(
        "worker rank 0 (local rank 0, pid 100) was killed by signal SIGKILL"
    )
    # the agent's SIGTERMs keep their place at the end
    error = _child_failed((0, 100, -signal.SIGTERM), (1, 101, 3), (2, 102, 3))
    summary = failure_summary(error, exit_times={100: 5.2, 101: 5.1, 102: 5.0})
    assert re.match(
        r"worker rank 2 .* exited with code 3; worker rank 1 .* exited with code 3; "
        r"the launcher then stopped worker rank\(s\) 0 \(each worker's own output is above\)$",
        summary,
    ), summary


DIES_THEN_PEER_FAILS = textwrap.dedent("""
    import os, signal, sys, time
    folder, how = sys.argv[1], sys.argv[2]
    if os.environ["RANK"] == "1":
        with open(os.path.join(folder, "rank1.pid"), "w") as handle:
            handle.write(str(os.getpid()))
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)  # the first failure: killed (the OOM killer) ...
        os._exit(7)  # ... or a crash with exit code 7
    # rank 0 fails because its peer is gone, and only once the launcher has noted that exit
    while not os.path.exists(os.path.join(folder, "rank1.pid")):
        time.sleep(0.01)
    pid = open(os.path.join(folder, "rank1.pid")).read().strip()
    while not pid or not os.path.exists(os.path.join(folder, f"noted-{pid}")):
        time.sleep(0.01)
        pid = open(os.path.join(folder, "rank1.pid")).read().strip()
    sys.exit(1)
""")


@pytest.fixture
def both_exits_in_one_poll(tmp_path, monkeypatch):
    """The test decides what the agent sees: the launcher's exit watch leaves a file for every exit it notes
    (rank 0 waits for rank 1's before it exits), and the agent's first look at its workers waits until both
    exits were noted. However the machine schedules the processes, one poll then sees both failures."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    import dpkit.launch.agent as agent

    watches = []

    class NotingExitWatch(agent.ExitWatch):
        def start(self):
            watches.append(self)
            return super().start()

        def _note_exits(self, timeout_ms):
            running = super()._note_exits(timeout_ms)
            for pid in list(self.exit_times):
                (tmp_path / f"noted-{pid}").touch()
            return running

    original = LocalElasticAgent._monitor_workers

    def monitor_after_both_exits(self, worker_group):
        deadline = time.monotonic() + 120  # a guard against a broken watch, not a race: the exits take milliseconds
        while len(watches[-1].exit_times) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        return original(self, worker_group)

    monkeypatch.setattr(agent, "ExitWatch", NotingExitWatch)
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", monitor_after_both_exits)
    return tmp_path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds are Linux's")
@pytest.mark.parametrize(
    "how,named",
    [
        (
            "killed",
            r"worker rank 1 \(local rank 1, pid \d+\) was killed by signal SIGKILL \(not for memory: [^;]*; [^;]*; "
            r"worker rank 0 .* exited with code 1",
        ),
        (
            "exit-code",
            r"worker rank 1 \(local rank 1, pid \d+\) exited with code 7; worker rank 0 .* exited with code 1",
        ),
    ],
    ids=["killed", "exit-code"],
)
def test_the_worker_that_failed_first_is_named_first_when_both_fail_in_one_poll(both_exits_in_one_poll, how, named):
    folder = both_exits_in_one_poll
    script = folder / "dies.py"
    script.write_text(DIES_THEN_PEER_FAILS)
    with pytest.raises(LaunchError) as error:
        launch(str(script), [str(folder), how], nproc_per_node=2)
    assert re.match(named, str(error.value)), str(error.value)
    assert error.value.exit_codes == {0: 1, 1: -signal.SIGKILL if how == "killed" else 7}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds are Linux's")
def test_the_exit_watch_notes_which_child_exited_first():
    from dpkit.launch.failures import ExitWatch

    watch = ExitWatch(expected=2).start()
    children = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        deadline = time.monotonic() + 10
        while len(watch._watched) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        children[1].kill()
        while children[1].pid not in watch.exit_times and time.monotonic() < deadline + 30:
            time.sleep(0.01)  # the second kill waits until the first exit is noted: their order is then certain
        children[0].kill()
        for child in children:
            child.wait()  # reaped before the watch stops: the exits were noted when they happened
    finally:
        for child in children:
            child.kill()
        watch.stop()
    times = watch.exit_times
    assert set(times) == {child.pid for child in children}
    assert times[children[1].pid] < times[children[0].pid]
    assert watch._watched == {}


# --- the script, checked before any worker starts; nproc_per_node="auto" -----------------------------------


def test_a_missing_script_is_one_error_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as error:
        launch("missing.py", nproc_per_node=2)
    assert str(error.value) == (
        "script: no such file 'missing.py'; expected a Python file to run (or, with module=True, a module name)"
    )
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="script: 'folder' is a folder without __main__.py"):
        launch("folder", nproc_per_node=2)


@pytest.mark.parametrize(
    "name,problem",
    [
        ("no_such_module_here", "no module named 'no_such_module_here'"),
        ("dpkit.no_such_module", "no module named 'dpkit.no_such_module'"),
        ("no_such_package.train", "no module named 'no_such_package'"),
        ("dpkit.strategies", "'dpkit.strategies' is a package without a __main__ module"),
        ("my-script.py", "'my-script.py' is not a module name (dotted identifiers, e.g. mypackage.train)"),
    ],
)
def test_a_module_python_m_would_not_find_is_refused(name, problem):
    with pytest.raises(ValueError) as error:
        launch(name, nproc_per_node=2, module=True)
    assert str(error.value).startswith(f"script: {problem}; with module=True the script is a module to run as")


def test_a_module_in_the_current_folder_is_found_as_the_workers_will_find_it_without_running_it(tmp_path, monkeypatch):
    from dpkit.launch.worker import check_script

    package = tmp_path / "launch_check_package"
    package.mkdir()
    (package / "__init__.py").write_text("open('imported', 'w').close()\n")
    (package / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    check_script("launch_check_package.train", module=True)  # the workers run with the current folder on sys.path
    assert str(tmp_path) not in sys.path  # the launcher's own path is left as it was
    assert "launch_check_package" not in sys.modules and not (tmp_path / "imported").exists()  # nothing ran here
    with pytest.raises(ValueError, match="no module named 'launch_check_package.evaluate'"):
        check_script("launch_check_package.evaluate", module=True)
    check_script("dpkit.cli.main", module=True)  # what dpkit train's relaunch runs


def test_nproc_per_node_auto_is_every_gpu_else_two():
    import torch

    from dpkit.launch.agent import processes_per_node

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert processes_per_node("auto") == (gpus or 2)
    assert processes_per_node(3) == 3
    for bad in ("two", "3", 0, True, 2.0):
        with pytest.raises(ValueError, match="nproc_per_node: expected a positive int"):
            processes_per_node(bad)
