"""Issue 33's four cases under ddp and fsdp, launched as a user would (`dpkit launch --hang-timeout`): each ends
within the hang timeout plus start-up with a report naming the ranks, the collective or step and the script's
lines, and none trains on mismatched steps.

Nothing races a sleep against a timeout: a stuck rank waits on an event nobody sets; every other order (which
rank skips, which runs out) is the script's own, fixed by its arguments."""

from __future__ import annotations

import re
import textwrap
import time

import pytest

from dpkit.launch import LaunchError, launch

HANG_TIMEOUT = 5  # as test_restarts_and_progress: a loaded machine must not look hung
SCRIPT = textwrap.dedent("""\
    import os, sys, threading, torch
    from dpkit.engine.engine import Engine

    strategy, case, out = sys.argv[1], sys.argv[2], sys.argv[3]
    engine = Engine(strategy=strategy, accelerator="cpu", devices=2, timeout_seconds=120)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = torch.utils.data.TensorDataset(torch.randn(48, 4), torch.randn(48, 1))
    if case == "skip":  # the Engine's loader: both ranks draw 6 batches
        loader = engine.setup_dataloader(torch.utils.data.DataLoader(data, batch_size=8))
    else:  # the user's own loader: rank 1 has one batch fewer with "uneven" and "reduce"
        batches = 6 if engine.rank == 0 or case == "stuck" else 5
        loader = [(data.tensors[0][i * 4 : i * 4 + 4], data.tensors[1][i * 4 : i * 4 + 4]) for i in range(batches)]
    for step, (x, y) in enumerate(loader, 1):
        if case == "skip" and engine.rank == 1 and step == 3:
            continue  # rank 1 skips step 3's forward, backward and optimizer step
        optimizer.zero_grad()
        with open(os.path.join(out, f"rank{engine.rank}-step{step}"), "w"):
            pass
        if case == "stuck" and engine.rank == 1 and step == 3:
            threading.Event().wait()  # stuck for ever, outside any collective
        loss = torch.nn.functional.mse_loss(model(x), y)
        engine.backward(loss)
        optimizer.step()
        open(os.path.join(out, f"rank{engine.rank}-stepped{step}"), "w").close()
    if case == "reduce":
        engine.reduce(loss.detach())
    engine.close()
""")


def _line(text: str) -> int:
    """The script's line (from 1) that holds `text`: the line a report must name."""
    return next(number for number, line in enumerate(SCRIPT.splitlines(), 1) if text in line)


BACKWARD_LINE, FORWARD_LINE = _line("engine.backward(loss)"), _line("model(x)")
REDUCE_LINE, CLOSE_LINE, STUCK_LINE = _line("engine.reduce("), _line("engine.close()"), _line("Event().wait()")


def _run(tmp_path, strategy: str, case: str) -> tuple[str, float, set[str]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    began = time.monotonic()
    with pytest.raises(LaunchError) as error:
        launch(str(script), [strategy, case, str(tmp_path)], nproc_per_node=2, hang_timeout_seconds=HANG_TIMEOUT)
    files = {path.name for path in tmp_path.glob("rank*")}
    return str(error.value), time.monotonic() - began, files


def _stepped(files: set[str], rank: int) -> set[int]:
    return {int(name.split("stepped")[1]) for name in files if name.startswith(f"rank{rank}-stepped")}


# start-up (two processes importing torch on a shared machine) plus the hang timeout and the report
BOUND_SECONDS = 60


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_skipped_step_stops_both_ranks_before_the_optimizer_steps_naming_both(tmp_path, strategy):
    message, elapsed, files = _run(tmp_path, strategy, "skip")
    assert elapsed < BOUND_SECONDS, elapsed
    # rank 1's step 4 met rank 0's step 3: neither stepped on it, nor on anything after
    assert _stepped(files, 0) == {1, 2} and _stepped(files, 1) == {1, 2}, sorted(files)
    line = BACKWARD_LINE if strategy == "ddp" else FORWARD_LINE
    assert re.search(
        rf"CollectiveMismatch: rank 1 is at step 4 \(all_\w+[^,]*, train\.py:{line} in <module>\) "
        rf"while rank 0 is at step 3 \(all_\w+[^,]*, train\.py:{line} in <module>\): a rank skipped a step",
        message,
    ), message


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_uneven_batches_stop_at_once_naming_the_rank_that_ran_out(tmp_path, strategy):
    message, elapsed, files = _run(tmp_path, strategy, "uneven")
    assert elapsed < BOUND_SECONDS, elapsed
    assert 6 not in _stepped(files, 0)  # rank 0's sixth step met rank 1's close: not taken
    line = BACKWARD_LINE if strategy == "ddp" else FORWARD_LINE
    assert re.search(
        rf"rank 1 ran out of batches after 5 steps \(engine\.close, train\.py:{CLOSE_LINE} in <module>\) while "
        rf"rank 0 is at step 6 \(all_\w+[^,]*, train\.py:{line} in <module>\): the ranks' batch counts differ",
        message,
    ), message


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_reduce_that_meets_a_gradient_collective_is_named_at_both_lines(tmp_path, strategy):
    message, elapsed, files = _run(tmp_path, strategy, "reduce")
    assert elapsed < BOUND_SECONDS, elapsed
    assert 6 not in _stepped(files, 0)
    # gloo aborts on the size mismatch (ddp), or both wait in different collectives (fsdp): either way the
    # report names rank 1's reduce and rank 0's step at their lines
    assert f"train.py:{REDUCE_LINE} in <module>" in message, message
    # (when gloo aborts both, each worker's line says "killed by signal SIGABRT; its last collective: ...")
    assert re.search(
        rf"rank 0[^;]*(; its last collective: )?all_\w+[^;]*step 6, train\.py:({BACKWARD_LINE}|{FORWARD_LINE})", message
    ), message


# ddp only: the hang watch and the heartbeats that carry each rank's last collective are the same for every
# strategy with a process per device; fsdp's own collective record is named by the three cases above
def test_a_stuck_rank_is_named_with_its_collective_and_where_it_is(tmp_path):
    message, elapsed, files = _run(tmp_path, "ddp", "stuck")
    assert elapsed < BOUND_SECONDS, elapsed  # far below the Engine's 120 s collective timeout
    assert "rank1-step3" in files and "rank0-stepped3" not in files
    # the culprit comes first and is the one named as making no progress; rank 0 only waited
    assert re.match(
        rf"worker rank 1 \(pid \d+, node 0\) made no progress for \d+ s \(hang_timeout_seconds={HANG_TIMEOUT}\)",
        message,
    ), message
    assert "rank(s) 0 waited" in message and "worker rank 0" not in message
    assert re.search(r"last collectives: rank 0: all_\w+.*step 3, train\.py:\d+ in <module>\)", message), message
    assert f"rank 1 at train.py:{STUCK_LINE} in <module>" in message, message  # where rank 1 is now


# --- the parts, without processes ---------------------------------------------------------------------------


def test_a_heartbeat_carries_the_last_collective_on_a_second_line():
    from dpkit.launch.heartbeat import heartbeat_value, parse_collective, parse_heartbeat

    entry = {"sequence": 7, "op": "barrier", "size_bytes": 0, "step": 2, "site": "train.py:9 in main"}
    value = heartbeat_value(12, 345, 0, 1, 2.5, "saving the state", entry)
    assert parse_heartbeat(value) == (12, 345, 0, 1, 2.5, "saving the state")
    assert parse_collective(value) == entry
    assert parse_collective(heartbeat_value(12, 345, 0)) is None  # a rank that issued none yet


def _heartbeats(counts: dict[int, int]) -> dict:
    return {rank: (count, 100 + rank, 0, 0, 0.0, "") for rank, count in counts.items()}


def test_ranks_waiting_in_different_collectives_at_the_same_place_are_named_after_the_hang_timeout():
    from dpkit.launch.hang_watch import HangWatch

    watch = HangWatch("127.0.0.1", 1, world_size=2, node_rank=1, hang_timeout_seconds=10)  # node 1: kills nobody
    gather = {
        "sequence": 41,
        "op": "all_gather_single",
        "size_bytes": 232,
        "step": 6,
        "site": "train.py:23 in <module>",
    }
    close = {
        "sequence": 41,
        "op": "barrier (engine.close)",
        "size_bytes": 0,
        "step": 5,
        "site": "train.py:29 in <module>",
    }
    watch.collectives = {0: gather, 1: close}
    progress: dict = {}
    for now in (0, 5, 9):  # the same counts: neither is behind the other, so only this rule can see it
        watch._check(progress, _heartbeats({0: 50, 1: 50}), now=now)
    assert watch.hung == {}
    watch._check(progress, _heartbeats({0: 50, 1: 50}), now=11)
    assert watch.hung[1] == "" and watch.hung[0].startswith(
        "worker ranks 0, 1 wait in different collectives at the same place of their records, for 11 s "
        "(hang_timeout_seconds=10): rank 0 in all_gather_single of 232 B (collective 41, step 6, train.py:23 in "
        "<module>), rank 1 in barrier (engine.close) (collective 41, step 5, train.py:29 in <module>)"
    )

    # the same collective on both ranks is no mismatch: only the rule for a rank behind applies
    watch = HangWatch("127.0.0.1", 1, world_size=2, node_rank=1, hang_timeout_seconds=10)
    watch.collectives = {0: gather, 1: gather}
    progress = {}
    for now in (0, 11, 22):
        watch._check(progress, _heartbeats({0: 50, 1: 50}), now=now)
    assert watch.hung == {}


def test_the_user_s_frames_are_read_from_a_faulthandler_dump(tmp_path):
    import faulthandler

    from dpkit.launch.stacks import describe_frames, user_frames

    path = tmp_path / "stacks.txt"
    with open(path, "w") as handle:

        def inner():
            faulthandler.dump_traceback(handle, all_threads=True)

        inner()
        line = inner.__code__.co_firstlineno + 1
    frames = user_frames(path.read_text())
    assert frames[0] == (f"test_collective_faults.py:{line} in inner", "")
    assert frames[1][0].endswith("in test_the_user_s_frames_are_read_from_a_faulthandler_dump")
    assert frames[1][1] == "inner"  # the function that line was calling
    assert describe_frames(frames).startswith(f"test_collective_faults.py:{line} in inner, called from ")
    assert describe_frames([]) == "no Python frame of the user's code"


def test_a_rank_killed_by_a_signal_is_named_with_its_last_collective_and_line():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from dpkit.launch.failures import failure_summary

    failures = {}
    for rank, code in ((1, -6), (0, -15)):
        failures[rank] = ProcessFailure(local_rank=rank, pid=10 + rank, exitcode=code, error_file="/nonexistent")
        failures[rank].timestamp = 1
    entries = {
        1: {"sequence": 8, "op": "all_reduce", "size_bytes": 8, "step": 6, "site": "train.py:33 in <module>"},
        0: {"sequence": 8, "op": "all_reduce of gradient bucket 0", "size_bytes": 4, "step": 6, "site": "train.py:24"},
    }
    summary = failure_summary(
        ChildFailedError("worker", failures),
        collectives=entries,
        fatal_stacks={1: "train.py:33 in <module> (calling reduce)"},
    )
    assert summary.startswith(
        "worker rank 1 (local rank 1, pid 11) was killed by signal SIGABRT; its last collective: all_reduce of 8 B "
        "(collective 8, step 6, train.py:33 in <module>); it was at train.py:33 in <module> (calling reduce)"
    ), summary
    assert "; the launcher then stopped worker rank(s) 0; rank 0 was in all_reduce of gradient bucket 0 " in summary
