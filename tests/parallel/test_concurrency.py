"""Concurrency as a declared policy: threads, serial, auto measured once and frozen; the choice given back; results
bitwise the same either way; the worker threads' lifetime."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from torch import nn

import dpkit
from dpkit.parallel import sync_batchnorm, workers
from dpkit.parallel.apply import hold_workers, parallel_apply, run_replicas
from dpkit.parallel.concurrency import Concurrency, concurrency_decided, site_choices, site_policies

DEVICES = dpkit.cpu_devices(3)


def test_auto_measures_both_ways_alternately_then_freezes_the_faster():
    policy = Concurrency("auto")
    ways = []
    for _ in range(policy.WARMUP + 2 * policy.SAMPLES):
        assert policy.choice() is None
        way = policy.way()
        ways.append(way)
        policy.ran(way, 1.0 if way == "serial" else 2.0)  # serial is faster here
    assert ways == ["threads", "serial"] * (policy.WARMUP // 2 + policy.SAMPLES)
    assert policy.choice() == "serial"
    for _ in range(50):  # frozen: what the machine does later changes nothing
        policy.ran(policy.way(), 100.0)
    assert policy.choice() == policy.way() == "serial"
    assert [len(v) for v in policy.measured().values()] == [policy.SAMPLES] * 2


def test_a_near_tie_keeps_threads_and_declared_ways_measure_nothing():
    for serial_seconds, chosen in ((1.0, "threads"), (0.97, "threads"), (0.9, "serial")):
        policy = Concurrency("auto")  # serial wins only when clearly faster (SERIAL_MARGIN: 5%)
        while policy.choice() is None:
            way = policy.way()
            policy.ran(way, serial_seconds if way == "serial" else 1.0)
        assert policy.choice() == chosen
    for declared in ("threads", "serial"):
        policy = Concurrency(declared)
        policy.ran(declared, 1.0)
        assert policy.way() == policy.choice() == declared and policy.measured() == {"threads": [], "serial": []}


def test_threads_measuring_one_call_site_at_once_reach_one_choice():
    policy = Concurrency("auto")
    start = threading.Barrier(4)

    def hammer() -> None:
        start.wait()
        for _ in range(200):
            way = policy.way()
            policy.ran(way, 1.0 if way == "threads" else 3.0)

    workers = [threading.Thread(target=hammer) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert policy.choice() == "threads"
    measured = policy.measured()  # counted under the lock: nothing lost or counted past the decision
    assert len(measured["serial"]) == policy.SAMPLES and len(measured["threads"]) >= policy.SAMPLES


def test_a_copy_keeps_the_choice_and_a_copy_made_while_measuring_measures_again():
    policy = Concurrency("auto")
    while policy.choice() is None:
        policy.ran(policy.way(), 1.0 if policy.way() == "serial" else 2.0)
    assert copy.deepcopy(policy).choice() == pickle.loads(pickle.dumps(policy)).choice() == "serial"
    assert copy.deepcopy(Concurrency("auto")).choice() is None


def test_bad_concurrency_is_named_with_what_is_accepted():
    with pytest.raises(ValueError, match=r"^concurrency: expected 'threads', 'serial' or 'auto', got 'fast'$"):
        dpkit.DataParallel(nn.Linear(2, 2), DEVICES, concurrency="fast")
    with pytest.raises(ValueError, match=r"concurrency: 'forward' is not a call site here; the call sites are train"):
        dpkit.DataParallel(nn.Linear(2, 2), DEVICES, concurrency={"forward": "serial"})
    with pytest.raises(ValueError, match=r"concurrency\['eval'\]: expected 'threads', 'serial' or 'auto', got 'x'"):
        site_policies({"eval": "x"}, ("train", "eval"))
    with pytest.raises(TypeError, match="concurrency: expected 'threads', 'serial', 'auto' or a dict"):
        dpkit.DataParallel(nn.Linear(2, 2), DEVICES, concurrency=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="concurrency: 'auto' measures across calls"):
        parallel_apply([nn.Linear(2, 2)] * 2, [torch.ones(1, 2)] * 2, concurrency="auto")
    with pytest.raises(ValueError, match="way: expected 'threads' or 'serial', got 'auto'"):
        concurrency_decided("auto").__enter__()


class Recorder(nn.Module):
    """Wide enough that a sum's order would show in the last bits; dropout draws from the replicas' generators;
    records the thread each replica's forward ran in."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 96), nn.Tanh(), nn.Linear(96, 96), nn.Linear(96, 8), nn.Dropout(0.3))
        self.threads: list[str] = []

    def forward(self, x):
        self.threads.append(threading.current_thread().name)
        return self.net(x)


def train_dp(concurrency, steps: int = 3) -> tuple[list, list, set[str], dpkit.DataParallel]:
    torch.manual_seed(0)
    model = Recorder()
    dp = dpkit.DataParallel(model, DEVICES, concurrency=concurrency)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # the replicas' generators are seeded from the default one
    outputs = []
    for _ in range(steps):
        out = dp(torch.randn(20, 16, generator=generator))  # 7, 7, 6 rows
        optimizer.zero_grad()
        out.square().sum().backward()
        optimizer.step()
        outputs.append(out.detach())
    return outputs, [p.grad.clone() for p in model.parameters()], set(model.threads), dp


def test_serial_and_threads_give_bitwise_equal_outputs_gradients_and_weights():
    out_threads, grads_threads, ran_threads, dp_threads = train_dp("threads")
    out_serial, grads_serial, ran_serial, dp_serial = train_dp("serial")
    assert all(torch.equal(a, b) for a, b in zip(out_threads, out_serial))
    assert (out_threads[0] == 0).any()  # dropout ran
    assert all(torch.equal(a, b) for a, b in zip(grads_threads, grads_serial))  # max difference 0
    assert all(torch.equal(a, b) for a, b in zip(dp_threads.parameters(), dp_serial.parameters()))
    assert ran_serial == {threading.current_thread().name}
    assert ran_threads == {f"dpkit-cpu:{i}_0" for i in range(len(DEVICES))}


def test_autos_frozen_choice_is_what_a_second_run_reuses_from_its_first_call():
    first = dpkit.DataParallel(Recorder(), DEVICES)  # auto
    policy = first.concurrency["train"]
    for _ in range(policy.WARMUP + 2 * policy.SAMPLES):
        assert first.concurrency_choice() == {}
        first(torch.randn(6, 16))
    recorded = first.concurrency_choice()
    assert set(recorded) == {"train"} and recorded["train"] in ("threads", "serial")  # eval never ran: measuring
    again = pickle.loads(pickle.dumps(recorded))  # a plain value, as a run's state keeps it
    model = Recorder()
    second = dpkit.DataParallel(model, DEVICES, concurrency=again)
    assert second.concurrency_choice() == recorded  # decided before its first call
    second(torch.randn(6, 16))
    on_caller = model.threads == [threading.current_thread().name] * len(DEVICES)
    assert on_caller is (recorded["train"] == "serial")
    assert second.concurrency["train"].measured() == {"threads": [], "serial": []}  # nothing measured again
    assert second.concurrency["eval"].declared == "auto"
    assert site_choices(second.concurrency) == recorded
    late = dpkit.DataParallel(Recorder(), DEVICES)  # made before the state is loaded, as an Engine's wrapper is
    late.set_concurrency(recorded)
    assert late.concurrency_choice() == recorded


def test_a_way_decided_for_the_thread_runs_every_auto_call_site_so_and_measures_nothing():
    auto, declared = Concurrency("auto"), Concurrency("threads")
    here = threading.current_thread().name
    with concurrency_decided("serial"):
        for _ in range(auto.WARMUP + 2 * auto.SAMPLES + 2):
            assert set(run_replicas(DEVICES, lambda i: threading.current_thread().name, concurrency=auto)) == {here}
        assert here not in run_replicas(DEVICES, lambda i: threading.current_thread().name, concurrency=declared)
    assert auto.choice() is None and auto.measured() == {"threads": [], "serial": []}


def test_serial_jobs_run_on_the_calling_thread_with_their_devices_share_of_threads():
    share = dpkit.devices.cpu_threads_per_device(len(DEVICES))
    before = torch.get_num_threads()

    def seen(i: int) -> tuple[threading.Thread, int]:
        return threading.current_thread(), torch.get_num_threads()

    results = run_replicas(DEVICES, seen, concurrency="serial")
    assert results == [(threading.current_thread(), share)] * len(DEVICES)
    assert torch.get_num_threads() == before  # the calling thread's own count is back


def test_an_error_in_a_serial_run_names_the_replica_and_device_and_the_runner_stays_usable():
    def job(i: int):
        if i == 1:
            raise ValueError("bad rows")
        return i

    with pytest.raises(ValueError, match="in replica 1 on device cpu:1: ValueError: bad rows"):
        run_replicas(DEVICES, job, concurrency="serial")
    assert run_replicas(DEVICES, lambda i: i, concurrency="serial") == [0, 1, 2]


def test_a_serial_run_that_reaches_a_wait_for_the_other_replicas_raises_instead_of_hanging():
    replicas = [nn.SyncBatchNorm(4).train() for _ in DEVICES]  # persistent replicas, as `replicated` keeps
    sync_batchnorm.link_replicas(replicas)
    job, group = sync_batchnorm.synced_job(replicas[0], lambda i: replicas[i](torch.randn(5, 4)), len(DEVICES))
    assert group is not None
    with pytest.raises(RuntimeError, match="declare concurrency='threads' for this call site"):
        run_replicas(DEVICES, job, concurrency="serial")
    # DataParallel's replicas with SyncBatchNorm run side by side whatever is declared
    dp = dpkit.DataParallel(nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4)), DEVICES, concurrency="serial")
    assert dp(torch.randn(9, 4)).shape == (9, 4)


def test_workers_are_daemons_kept_while_leased_and_started_again_after_the_last_lease(monkeypatch):
    # leases an earlier test of this process left held (an Engine never closed) would keep the workers alive:
    # count from none, and give the count back afterwards (the workers start again for whoever needs them)
    monkeypatch.setattr(workers, "_leases", 0)
    first, second = hold_workers(), hold_workers()
    threads = run_replicas(DEVICES, lambda i: threading.current_thread())
    kept = workers.worker_for(DEVICES[0])
    assert all(t.daemon and t.is_alive() for t in threads)  # an idle worker never holds up the exit
    first.release()
    first.release()  # idempotent: counts once
    assert all(t.is_alive() for t in threads)
    with second:
        pass  # released at the end of the block: the last lease, the workers stop
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="dpkit-cpu:0_0: this worker was stopped"):
        kept.submit(lambda: None)  # never queued behind the stop, where it would wait forever
    again = run_replicas(DEVICES, lambda i: threading.current_thread())
    assert all(t.is_alive() for t in again) and not set(again) & set(threads)
    assert workers._leases == 0


def test_auto_keeps_threads_for_long_jobs_however_fast_serial_measured():
    """Serial is kept only for short jobs: a site whose jobs take tens of ms keeps threads even when serial measured
    faster (as it does while other processes hold the cores), so the run is not halved once they free up."""
    for serial, threads, chosen in ((0.080, 0.090, "threads"), (0.0018, 0.0021, "serial")):
        policy = Concurrency("auto")
        while policy.choice() is None:
            way = policy.way()
            policy.ran(way, serial if way == "serial" else threads, jobs=2)
        assert policy.choice() == chosen


def test_threaded_replicas_leave_the_callers_thread_count_as_it_was():
    """A caller that never asked torch for its thread count keeps its own (here 2) after the replicas ran in threads
    with their share (1 each on 2 devices)."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, dpkit\nfrom torch import nn\n"
        "dpkit.DataParallel(nn.Linear(4, 2), dpkit.cpu_devices(2), concurrency='threads')(torch.randn(6, 4))\n"
        "print(torch.get_num_threads())\n"
    )
    environment = {**os.environ, "OMP_NUM_THREADS": "2"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environment)
    assert result.stdout.split() == ["2"], result.stdout
