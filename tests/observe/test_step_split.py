"""The step by thread (observe/step_split.py): the calling thread's own work by phase, its waits for the replica
threads, and what each replica thread did meanwhile; in the report, its JSON and its table."""

import json
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import dpkit
from dpkit.observe import Observer
from dpkit.observe.step_split import REPLICA_PARTS
from dpkit.parallel import hooks
from dpkit.parallel.apply import run_replicas
from dpkit.parallel.concurrency import concurrency_decided

DEVICES = dpkit.cpu_devices(2)
PARTS = [f"{part}_seconds" for part in REPLICA_PARTS]


def engine_steps(strategy, devices, steps=3, **observer_options):
    torch.manual_seed(0)
    engine = dpkit.Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False)
    bare = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model, optimizer = engine.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
    criterion = engine.setup_criterion(F.cross_entropy)
    x, y = torch.randn(12, 8), torch.randint(0, 4, (12,))

    def step():
        optimizer.zero_grad()
        engine.backward(criterion(model(x), y))
        optimizer.step()

    with concurrency_decided("threads"):  # what these tests observe: the replicas in their threads
        step()
        with Observer(engine.device, **observer_options) as observer:
            for _ in range(steps):
                step()
    engine.close()
    return observer.report()


@pytest.mark.parametrize("strategy", ["dp", "replicated"])
def test_each_replica_threads_parts_add_up_to_the_callers_wait(strategy):
    threads = engine_steps(strategy, 2, memory=False).threads
    caller = threads["calling_thread"]
    assert threads["steps"] == 3 and caller["hand_offs"] >= 1
    assert [r["device"] for r in threads["replica_threads"]] == ["cpu:0", "cpu:1"]
    for replica in threads["replica_threads"]:
        assert all(replica[part] >= 0 for part in PARTS)
        assert sum(replica[part] for part in PARTS) == pytest.approx(caller["waiting_seconds"], rel=1e-9, abs=1e-12)
        assert replica["running_seconds"] > 0 and replica["jobs"] == caller["hand_offs"]
    # the calling thread's time: its own phases, "other", and its waits make up the whole step
    own = sum(caller["own_seconds_by_phase"].values())
    assert own == pytest.approx(caller["own_seconds"])
    assert own + caller["waiting_seconds"] == pytest.approx(threads["step_seconds"], rel=1e-6)
    assert caller["running_seconds"] + caller["descheduled_seconds"] + caller["blocked_seconds"] == pytest.approx(own)


def test_dp_names_scatter_replicate_gather_and_backward_on_the_calling_thread():
    report = engine_steps("dp", 2, memory=False, backward_by_device=False)
    own = report.threads["calling_thread"]["own_seconds_by_phase"]
    assert {"scatter", "replicate", "gather", "loss", "backward", "optimizer", "other"} <= set(own)
    assert "backward" not in report.device("cpu:1").seconds_by_phase  # unmarked: all the caller's, on cpu:0
    assert report.threads["replica_threads"][0]["jobs"] == 1  # one hand-off per step: the forward


def test_one_device_has_no_replica_threads_and_its_step_is_the_calling_threads():
    threads = engine_steps("single", 1, memory=False).threads
    assert threads["replica_threads"] == [] and threads["calling_thread"]["waiting_seconds"] == 0
    assert threads["calling_thread"]["own_seconds"] == pytest.approx(threads["step_seconds"], rel=1e-6)
    assert {"forward", "backward", "optimizer"} <= set(threads["calling_thread"]["own_seconds_by_phase"])


def test_a_wait_for_the_other_replicas_is_booked_as_such_not_as_the_gil():
    with Observer("cpu:0", memory=False) as observer:

        def job(i):
            if i == 1:
                with hooks.peer_wait():
                    time.sleep(0.02)

        run_replicas(DEVICES, job, generators=False)
    threads = observer.report().threads
    waiting = {r["device"]: r for r in threads["replica_threads"]}
    assert waiting["cpu:1"]["peers_seconds"] >= 0.02  # its own wait
    assert waiting["cpu:0"]["peers_seconds"] > 0  # after its job, for cpu:1's to end


def test_without_memory_accounts_no_dispatch_mode_runs_in_the_calling_thread():
    # compared with what runs before: an observer an earlier test in this process left started (a balance
    # measurement stopped by its wrapper's finalizer, which garbage collection has not run yet) keeps the shared
    # tracker entered, and a memory-less observer must add nothing to it
    before = _get_current_dispatch_mode()
    seen = []
    with Observer("cpu:0", memory=False):
        seen.append(_get_current_dispatch_mode())
    with Observer("cpu:0"):
        seen.append(_get_current_dispatch_mode())
    assert seen[0] is before and type(seen[1]).__name__ == "CallingThreadTracker"


def test_the_split_is_in_the_json_and_under_the_table(tmp_path):
    report = engine_steps("replicated", 2)
    data = json.loads(report.save_json(tmp_path / "r.json").read_text())
    threads = data["threads"]
    assert threads["memory_accounting"] is True and threads["steps"] == 3
    assert set(threads["calling_thread"]) == {
        "own_seconds",
        "own_seconds_by_phase",
        "running_seconds",
        "descheduled_seconds",
        "blocked_seconds",
        "waiting_seconds",
        "hand_offs",
    }
    assert set(threads["replica_threads"][0]) == {"device", "jobs", *PARTS}
    table = report.format_table()
    assert "ms by thread (ms per step): calling thread" in table
    assert "while it waits: cpu:" in table and "hand-off" in table and "GIL" in table
    assert "memory accounting was on" in table


def test_a_report_without_timing_has_no_split():
    with Observer("cpu:0", timing=False) as observer:
        torch.ones(3)
    report = observer.report()
    assert report.threads is None and "threads" not in report.to_dict()
    assert "by thread" not in report.format_table()


def test_phases_from_another_thread_do_not_enter_the_calling_threads_split():
    with Observer("cpu:0", memory=False) as observer:

        def elsewhere():
            with observer.phase("loss"):
                pass

        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join()
        with observer.phase("optimizer"):
            pass
    own = observer.report().threads["calling_thread"]["own_seconds_by_phase"]
    assert "loss" not in own and "optimizer" in own


def test_replicas_that_take_turns_on_the_calling_thread_are_its_replicas_phase(tmp_path):
    from dpkit.observe.report import thread_lines

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    dp = dpkit.DataParallel(model, DEVICES, concurrency="serial")  # the jobs run on the calling thread
    x = torch.randn(12, 8)
    with Observer("cpu:0", memory=False) as observer:
        for _ in range(3):
            dp(x).sum().backward()
    report = observer.report()
    caller = report.threads["calling_thread"]
    assert report.threads["replica_threads"] == [] and caller["hand_offs"] == 0
    own = caller["own_seconds_by_phase"]
    assert own["replicas"] > 0 and list(own).index("replicas") == list(own).index("replicate") + 1
    assert own["replicas"] + sum(v for k, v in own.items() if k != "replicas") == pytest.approx(caller["own_seconds"])
    assert report.device("cpu:1").seconds_by_phase["forward"] > 0  # each replica's forward is still its device's
    assert any("replica jobs that ran in turns on the calling thread" in line for line in thread_lines(report.threads))
