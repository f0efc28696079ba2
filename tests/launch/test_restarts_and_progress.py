"""Restarts never retry what cannot succeed (exit 2: bad input, 3: training diverged), and the hang watch
knows what progress is: a rank inside `busy()` (rank 0 saving the state) is working, not hung."""

from __future__ import annotations

import logging
import os
import re
import signal
import textwrap
import time

import pytest

from dpkit.cli.main import main
from dpkit.launch import LaunchError, busy, launch

# --- restarts -----------------------------------------------------------------------------------------

# rank 1 fails on every attempt; rank 0 waits for ever (the agent stops it). Each attempt leaves a file.
FAILS_EVERY_TIME = textwrap.dedent("""
    import os, sys, time
    out, how = sys.argv[1], sys.argv[2]
    attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    open(os.path.join(out, f"attempt-{attempt}-rank-{rank}"), "w").close()
    if os.environ["RANK"] == "1":
        if how == "kill":
            os.kill(os.getpid(), 9)
        sys.exit(int(how))
    time.sleep(600)
""")


def _attempts(folder) -> set[int]:
    return {int(path.name.split("-")[1]) for path in folder.glob("attempt-*")}


@pytest.mark.parametrize("code,meaning", [(2, "bad input"), (3, "training diverged")])
def test_a_worker_exiting_with_2_or_3_ends_the_job_instead_of_a_restart(tmp_path, capfd, code, meaning):
    script = tmp_path / "fails.py"
    script.write_text(FAILS_EVERY_TIME)
    # `dpkit launch` in this process: its exit code is what main returns
    returned = main(["launch", "--max-restarts", "3", "--nproc-per-node", "2", str(script), str(tmp_path), str(code)])
    stdout, stderr = capfd.readouterr()
    assert returned == code, stdout + stderr
    assert _attempts(tmp_path) == {0}  # never restarted
    summaries = [line for line in stderr.splitlines() if line.startswith("dpkit launch: error:")]
    assert len(summaries) == 1, stderr
    assert re.match(
        rf"dpkit launch: error: worker rank 1 \(local rank 1, pid \d+\) exited with code {code} "
        rf"\({meaning}, not retried\); the launcher then stopped worker rank\(s\) 0",
        summaries[0],
    ), summaries[0]


def test_without_restarts_the_worker_s_code_is_still_the_exit_code(tmp_path):
    import torch.distributed.launcher.api as torch_launcher

    torch_agent = torch_launcher.LocalElasticAgent
    script = tmp_path / "fails.py"
    script.write_text(FAILS_EVERY_TIME)
    with pytest.raises(LaunchError) as error:
        launch(str(script), [str(tmp_path), "3"], nproc_per_node=2)
    assert error.value.exit_code == 3 and error.value.exit_codes[1] == 3
    assert "exited with code 3" in str(error.value) and "not retried" not in str(error.value)
    assert torch_launcher.LocalElasticAgent is torch_agent  # dpkit's agent only for the length of a launch


@pytest.mark.parametrize("how", ["1", "kill"])
def test_a_crash_or_a_kill_is_still_retried(tmp_path, how, caplog):
    script = tmp_path / "fails.py"
    script.write_text(FAILS_EVERY_TIME)
    with caplog.at_level(logging.WARNING, logger="dpkit"), pytest.raises(LaunchError) as error:
        launch(str(script), [str(tmp_path), how], nproc_per_node=2, max_restarts=1)
    assert _attempts(tmp_path) == {0, 1}  # restarted once, as asked
    # the restart is announced in one line naming the worker that ended it
    died = "was killed by SIGKILL" if how == "kill" else "exited with code 1"
    restarts = [r.getMessage() for r in caplog.records if "restart 1 of 1" in r.getMessage()]
    assert len(restarts) == 1 and f"launch: worker rank 1 {died}" in restarts[0], caplog.text
    assert error.value.exit_code == 1  # a failure, not bad input (2), which a requeue script would give up on
    assert "not retried" not in str(error.value)
    if how == "kill":  # who sent a SIGKILL: the kernel counted no out-of-memory kill, so another process
        assert "was killed by signal SIGKILL (not for memory: " in str(error.value), str(error.value)


def test_a_sigkill_says_whether_the_kernel_killed_for_memory():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from dpkit.launch.failures import failure_summary, oom_kills

    assert isinstance(oom_kills(), int)  # Linux counts them in /proc/vmstat
    error = ChildFailedError("worker", _failures((1, -signal.SIGKILL)))
    assert "was killed by signal SIGKILL (out of memory: the kernel killed 2 process(es) for memory" in (
        failure_summary(error, oom_kills_during=2)
    )
    assert "(not for memory: " in failure_summary(error, oom_kills_during=0)
    assert "memory" not in failure_summary(error)  # not known: nothing said


def _failures(*records):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {}
    for rank, exitcode in records:
        failures[rank] = ProcessFailure(
            local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="/nonexistent/error.json"
        )
        failures[rank].timestamp = 1_000
    return failures


@pytest.mark.parametrize(
    "records,expected",
    [
        ([(0, 3)], 3),
        ([(0, 2), (1, 2)], 2),
        ([(0, 3), (1, -signal.SIGTERM)], 3),  # the other was stopped by the agent because of it
        ([(0, 3), (1, 128 + signal.SIGTERM)], 3),  # … through dpkit's own SIGTERM handler
        ([(0, -signal.SIGKILL), (1, 2)], None),  # a kill may be the cause of it all: retried
        ([(0, 1), (1, 3)], None),
        ([(0, -signal.SIGTERM)], None),
        ([(0, 5)], None),
    ],
)
def test_only_a_failure_a_restart_would_repeat_is_deterministic(records, expected):
    from dpkit.launch.failures import deterministic_failure

    assert deterministic_failure(_failures(*records)) == expected


def test_ddp_training_that_diverges_is_not_restarted(tmp_path, capfd):
    out = tmp_path / "run"
    # `dpkit train` in this process, which starts the workers as its own process would
    code = main(
        ["train", "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2", "--lr", "1e30", "--steps", "5"]
        + ["--max-restarts", "3", "--out", str(out), "--no-progress"]
    )
    stdout, stderr = capfd.readouterr()
    assert code == 3, stdout + stderr
    lines = [line for line in stderr.splitlines() if not line.startswith(("INFO ", "DEBUG "))]
    # one attempt, where rank 0 alone says why (every attempt of a restarted group said it again before), once
    # (not once per process, nor two on one line)
    assert stderr.count("the loss became") == 1, stderr
    assert len(lines) == 1 and lines[0].startswith("dpkit train: error: --lr: the loss became "), lines
    assert not (out / "model.pt").exists()


# --- the hang watch and busy() ------------------------------------------------------------------------

HANG_TIMEOUT = 5  # as test_collective_faults: a loaded machine must not look hung
# longer than the hang timeout plus the watch's look every second and a margin: without busy(), the watch would
# have stopped rank 0 during such a save (test_without_busy_a_long_save_is_taken_for_a_hang)
SAVE_SECONDS = HANG_TIMEOUT + 3
# rank 0 "saves the state" (a sleep of SAVE_SECONDS, or for ever) while rank 1 waits in a barrier, as
# Engine.save_state does; then both train on, and with `hang-after` rank 1 gets stuck outside any busy block
SAVES = textwrap.dedent("""
    import contextlib, os, sys, time, torch
    from dpkit.launch import busy
    from dpkit.engine.engine import Engine

    out, mode, save_seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    engine = Engine(strategy="ddp", accelerator="cpu", devices=2, timeout_seconds=300)
    model = torch.nn.Linear(4, 1)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))

    def steps(n):
        for _ in range(n):
            optimizer.zero_grad()
            engine.backward(model(torch.randn(8, 4)).pow(2).mean())
            optimizer.step()

    steps(3)
    if engine.rank == 0:
        if mode == "stuck-in-busy":
            block = busy("writing to a dead mount", limit_seconds=1)
        elif mode == "no-busy":
            block = contextlib.nullcontext()
        else:
            block = busy("saving the training state")
        with block:
            time.sleep(save_seconds)
    engine.barrier()
    open(os.path.join(out, f"saved-{engine.rank}"), "w").close()
    steps(3)
    if mode == "hang-after":
        if engine.rank == 1:
            time.sleep(600)  # stuck outside any busy block: a real hang
        steps(1)  # rank 0 waits for it in the step's collective
    engine.close()
""")


def _run_saves(tmp_path, mode: str, save_seconds: float) -> tuple[LaunchError | None, float]:
    script = tmp_path / "saves.py"
    script.write_text(SAVES)
    began = time.monotonic()
    try:
        launch(
            str(script), [str(tmp_path), mode, str(save_seconds)], nproc_per_node=2, hang_timeout_seconds=HANG_TIMEOUT
        )
    except LaunchError as error:
        return error, time.monotonic() - began
    return None, time.monotonic() - began


def test_a_save_inside_busy_longer_than_the_hang_timeout_is_not_stopped_but_a_hang_after_it_is(tmp_path):
    error, elapsed = _run_saves(tmp_path, "hang-after", SAVE_SECONDS)
    assert (tmp_path / "saved-0").exists() and (tmp_path / "saved-1").exists()  # rank 0 lived through its save
    assert error is not None and elapsed < 200, elapsed  # far below the 300 s collective timeout
    message = str(error)
    # the rank that stopped outside a busy block is named, not rank 0, which only waited then
    assert re.match(
        rf"worker rank 1 \(pid \d+, node 0\) made no progress for \d+ s \(hang_timeout_seconds={HANG_TIMEOUT}\)",
        message,
    ), message
    assert "worker rank 0" not in message and "busy" not in message


def test_without_busy_a_long_save_is_taken_for_a_hang(tmp_path):
    error, elapsed = _run_saves(tmp_path, "no-busy", 600)
    assert error is not None and elapsed < 200, elapsed
    assert re.match(r"worker rank 0 \(pid \d+, node 0\) made no progress for \d+ s", str(error)), str(error)
    assert "rank(s) 1 waited" in str(error)
    assert not (tmp_path / "saved-0").exists()


def test_a_rank_stuck_inside_busy_past_its_limit_is_still_stopped(tmp_path):
    error, elapsed = _run_saves(tmp_path, "stuck-in-busy", 600)
    assert error is not None and elapsed < 200, elapsed
    message = str(error)
    assert re.match(r"worker rank 0 \(pid \d+, node 0\) made no progress for \d+ s", message), message
    assert "it has been busy (writing to a dead mount) for" in message and "past the 1 s" in message


def test_the_hang_rule_counts_a_busy_block_as_progress_up_to_its_limit():
    from dpkit.launch.hang_watch import HangWatch

    watch = HangWatch("127.0.0.1", 1, world_size=2, node_rank=1, hang_timeout_seconds=10)  # node 1: kills nobody
    progress = {}
    watch._check(progress, {0: (5, 100, 0, 0, 0.0, ""), 1: (5, 101, 0, 0, 0.0, "")}, now=0)
    # rank 0 saves (busy block 1, the default limit: 10 x 10 s) while rank 1 waits at the next collective
    for now in range(1, 100, 5):
        watch._check(progress, {0: (5, 100, 0, 1, 0.0, "saving the state"), 1: (6, 101, 0, 0, 0.0, "")}, now=now)
    assert watch.hung == {}
    # the block ended (progress), and rank 0 stays behind outside any block: the timeout runs from there
    watch._check(progress, {0: (5, 100, 0, 0, 0.0, ""), 1: (6, 101, 0, 0, 0.0, "")}, now=100)
    watch._check(progress, {0: (5, 100, 0, 0, 0.0, ""), 1: (6, 101, 0, 0, 0.0, "")}, now=109)
    assert watch.hung == {}
    watch._check(progress, {0: (5, 100, 0, 0, 0.0, ""), 1: (6, 101, 0, 0, 0.0, "")}, now=111)
    assert list(watch.hung) == [0] and "made no progress for 11 s" in watch.hung[0]

    # a block with its own limit of 20 s: progress until 20 s after it was first seen, then the timeout
    watch = HangWatch("127.0.0.1", 1, world_size=2, node_rank=1, hang_timeout_seconds=10)
    progress = {}
    stuck = {0: (5, 100, 0, 7, 20.0, "writing to a dead mount"), 1: (6, 101, 0, 0, 0.0, "")}
    for now in (0, 10, 20, 29):
        watch._check(progress, stuck, now=now)
    assert watch.hung == {}
    watch._check(progress, stuck, now=31)
    assert list(watch.hung) == [0]
    assert "made no progress for 31 s" in watch.hung[0]  # the time it really waited, its busy block's included
    assert "it has been busy (writing to a dead mount) for 31 s, past the 20 s" in watch.hung[0]


def test_a_heartbeat_value_carries_the_busy_state():
    from dpkit.launch.heartbeat import heartbeat_value, parse_heartbeat

    assert parse_heartbeat(heartbeat_value(12, 345, "1", 3, 2.5, "saving the state")) == (
        12,
        345,
        1,
        3,
        2.5,
        "saving the state",
    )
    assert parse_heartbeat(heartbeat_value(-1, 345, 0)) == (-1, 345, 0, 0, 0.0, "")
    assert parse_heartbeat("12 345 1") == (12, 345, 1, 0, 0.0, "")  # a worker of an older dpkit


def test_busy_nests_counts_as_the_outermost_block_and_costs_nothing_without_a_hang_watch():
    from dpkit.launch.heartbeat import _BUSY

    assert _BUSY.block == 0
    with busy("saving\tthe\nstate"):
        outer = _BUSY.block
        assert outer > 0 and _BUSY.reason == "saving the state"
        with busy("inner"):
            assert (_BUSY.block, _BUSY.reason) == (outer, "saving the state")
        assert _BUSY.block == outer
    assert _BUSY.block == 0
    with busy("next"):
        assert _BUSY.block > outer  # a new block, told apart from the last by the launcher
    with pytest.raises(KeyError), busy("failing"):
        raise KeyError("a failure inside the block")
    assert _BUSY.block == 0 and _BUSY.depth == 0


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"reason": 3}, TypeError, "reason: expected a str"),
        ({"reason": "x", "limit_seconds": 0}, ValueError, "limit_seconds: expected a finite number > 0, got 0"),
        ({"reason": "x", "limit_seconds": float("nan")}, ValueError, "limit_seconds: expected a finite number > 0"),
    ],
)
def test_busy_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match), busy(**kwargs):
        pass


def test_busy_is_exported_where_the_engine_imports_it():
    import dpkit.launch
    import dpkit.launch.heartbeat

    assert dpkit.launch.busy is dpkit.launch.heartbeat.busy
    assert os.environ.get("DPKIT_HANG_TIMEOUT_SECONDS") is None  # no watch here: busy() above was a no-op
