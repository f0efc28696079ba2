"""The one replica runner: order, named errors, Ctrl-C and SystemExit at once, generators, parallel_apply."""

from __future__ import annotations

import _thread
import threading
import time

import pytest
import torch
from torch import nn

import dpkit
from dpkit.parallel import apply, hooks
from dpkit.parallel.apply import parallel_apply, run_replicas

DEVICES = dpkit.cpu_devices(3)


def test_results_come_in_replica_order_from_each_devices_thread():
    def job(i: int):
        time.sleep(0.05 * (3 - i))  # the last replica finishes first
        return i, threading.current_thread().name

    results = run_replicas(DEVICES, job)
    assert [i for i, _ in results] == [0, 1, 2]
    assert [name.split("_")[0] for _, name in results] == [f"dpkit-cpu:{i}" for i in range(3)]


def test_an_error_names_the_replica_and_device_and_chains_the_original():
    def job(i: int):
        if i == 2:
            raise ValueError("bad rows")
        return i

    with pytest.raises(ValueError, match="in replica 2 on device cpu:2: ValueError: bad rows") as info:
        run_replicas(DEVICES, job)
    assert isinstance(info.value.__cause__, ValueError)
    assert run_replicas(DEVICES, lambda i: i) == [0, 1, 2]  # the runner stays usable


def test_a_replica_stopped_by_a_peers_failure_is_not_the_one_blamed():
    def job(i: int):
        if i == 0:
            raise apply.PeerFailed("stopped because another failed")
        time.sleep(0.05)
        raise KeyError("the real cause")

    with pytest.raises(KeyError, match="replica 1"):
        run_replicas(DEVICES[:2], job)


def test_ctrl_c_in_the_caller_returns_without_waiting_for_a_busy_replica():
    hold, finished, told = threading.Event(), threading.Event(), threading.Event()

    def job(i: int):
        if i == 1:
            _thread.interrupt_main()  # what Ctrl-C does to the main thread, while this replica is busy
            hold.wait(60.0)
            finished.set()
        return i

    try:
        with pytest.raises(KeyboardInterrupt):
            run_replicas(DEVICES[:2], job, on_interrupt=told.set)
        assert told.is_set()  # jobs that wait on each other are told to give up
        assert not finished.is_set()  # the caller came back while the replica was still busy
    finally:
        hold.set()
    assert run_replicas(DEVICES[:2], lambda i: i * 10) == [0, 10]  # waits for the abandoned job, then runs


def test_a_worker_stuck_since_an_interrupted_call_is_named_not_waited_for_forever(monkeypatch):
    release = threading.Event()

    def stuck(i: int):
        if i == 1:
            _thread.interrupt_main()
            release.wait(60.0)
        return i

    try:
        with pytest.raises(KeyboardInterrupt):
            run_replicas(DEVICES[:2], stuck)
        monkeypatch.setattr(apply, "ABANDONED_WAIT_SECONDS", 0.3)
        with pytest.raises(RuntimeError, match="device cpu:1: its worker thread is still running"):
            run_replicas(DEVICES[:2], lambda i: i)
    finally:
        release.set()
    assert run_replicas(DEVICES[:2], lambda i: i) == [0, 1]


@pytest.mark.parametrize("error", [SystemExit(3), KeyboardInterrupt()])
def test_system_exit_and_keyboard_interrupt_in_a_replica_pass_through_unchanged(error):
    def job(i: int):
        if i == 0:
            raise error
        return i

    with pytest.raises(type(error)) as info:
        run_replicas(DEVICES[:2], job)
    assert info.value is error


def test_replica_generators_make_dropout_repeatable_and_differ_between_replicas():
    def draw(i: int):
        return nn.functional.dropout(torch.ones(1000), 0.5)

    torch.manual_seed(5)
    first = run_replicas(DEVICES, draw)
    torch.manual_seed(5)
    again = run_replicas(DEVICES, draw)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], first[1])


def test_caller_grad_mode_and_autocast_are_re_entered():
    def state(i: int):
        return torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        results = run_replicas(DEVICES[:2], state)
    assert results == [(False, True, torch.bfloat16)] * 2
    assert run_replicas(DEVICES[:2], state)[1][:2] == (True, False)


def test_the_hooks_seam_sees_every_replica_in_its_thread():
    seen = []

    class Recorder:
        def replica(self, index, device):
            seen.append((index, str(device), threading.current_thread().name.split("_")[0]))
            return torch.autograd.grad_mode.no_grad()  # any context manager

    with hooks.listening_to(Recorder()):
        run_replicas(DEVICES[:2], lambda i: i)
    assert sorted(seen) == [(0, "cpu:0", "dpkit-cpu:0"), (1, "cpu:1", "dpkit-cpu:1")]


def test_parallel_apply_passes_a_bare_tensor_as_one_argument_as_torch_does():
    class CountArgs(nn.Module):
        def forward(self, *xs):
            return len(xs), xs[0].shape

    x = torch.randn(4, 3)
    results = parallel_apply([CountArgs(), CountArgs()], [x, (x, x)], None, ["cpu:0", torch.device("cpu", 1)])
    assert results == [(1, (4, 3)), (2, (4, 3))]


def test_parallel_apply_matches_the_modules_own_outputs_and_checks_lengths():
    modules = [nn.Linear(3, 2), nn.Linear(3, 2)]
    inputs = [torch.randn(4, 3), torch.randn(5, 3)]
    outputs = parallel_apply(modules, inputs)
    for module, x, out in zip(modules, inputs, outputs):
        assert torch.equal(out, module(x))
    with pytest.raises(ValueError, match="inputs: has 1 entries for 2 modules"):
        parallel_apply(modules, inputs[:1])
    with pytest.raises(ValueError, match="kwargs_tup: has 1 entries"):
        parallel_apply(modules, inputs, [{}])
    with pytest.raises(ValueError, match="devices"):
        parallel_apply(modules, inputs, None, ["cpu:0", "cpu:0"])


def test_turns_learn_the_faster_way_and_measure_again_later():
    turns = apply.Turns(relearn=30)
    ways = []
    for _ in range(turns.WARMUP + 2 * turns.SAMPLES):  # warm-up, then the two ways in alternation
        way = turns.next()
        ways.append(way)
        turns.ran(way, 1.0 if way else 2.0)  # taking turns is faster here
    assert ways[: turns.WARMUP] == [False] * turns.WARMUP
    assert sorted(ways[turns.WARMUP :]) == [False] * turns.SAMPLES + [True] * turns.SAMPLES
    assert turns.taking is True and turns.next() is True
    while turns.taking is not None:  # `relearn` runs later it measures again
        turns.ran(turns.next(), 1.0)
    for _ in range(2 * turns.SAMPLES):
        way = turns.next()
        turns.ran(way, 3.0 if way else 1.0)  # now side by side is faster
    assert turns.taking is False
    off = apply.Turns(enabled=False)
    for _ in range(20):
        assert off.next() is False
        off.ran(False, 1.0)
    assert off.runs == 0 and off.taking is None


def test_jobs_that_take_turns_run_one_at_a_time(monkeypatch):
    monkeypatch.setattr(apply, "TURN_TIMEOUT_SECONDS", 60.0)  # no job gives up waiting for its turn here
    running, most = [0], [0]
    lock = threading.Lock()

    def job(i: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.005)  # lets the GIL go: side by side, another job would start meanwhile
        with lock:
            running[0] -= 1
        return i

    turns = apply.Turns()
    turns.taking = True
    for _ in range(5):
        assert run_replicas(DEVICES, job, generators=False, turns=turns) == [0, 1, 2]
    assert most[0] == 1


def test_jobs_that_wait_for_each_other_finish_when_taking_turns():
    # a job holding its turn waits for the others, who wait for their turn only TURN_TIMEOUT_SECONDS
    barrier = threading.Barrier(len(DEVICES))
    turns = apply.Turns()
    turns.taking = True
    assert run_replicas(DEVICES, lambda i: barrier.wait(timeout=30) >= 0 and i, turns=turns) == [0, 1, 2]


def test_data_parallel_learns_per_training_mode_and_copies_learn_anew():
    import copy

    dp = dpkit.DataParallel(nn.Linear(4, 4), DEVICES)
    for _ in range(3):
        dp(torch.randn(6, 4))
    assert dp.turns[True].runs == 3 and dp.turns[False].runs == 0
    with torch.no_grad():
        dp.eval()(torch.randn(6, 4))
    assert dp.turns[False].runs == 1
    assert copy.deepcopy(dp).turns[True].runs == 0


def learned_turns() -> apply.Turns:
    """Turns that learned, in clean runs, that taking turns is faster: its jobs may run on the calling thread."""
    turns = apply.Turns()
    turns.taking, turns.clean_runs = True, turns.SAMPLES
    return turns


class ThreadRecorder(nn.Module):
    """Dropout and a linear layer; records the thread and intra-op threads each replica's forward ran with."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 4)
        self.dropout = nn.Dropout(0.5)
        self.seen: list[tuple[str, int]] = []

    def forward(self, x):
        self.seen.append((threading.current_thread().name, torch.get_num_threads()))
        return self.dropout(self.linear(x))


def test_learned_turns_run_on_the_calling_thread_with_the_results_of_the_worker_threads():
    torch.manual_seed(0)
    original = ThreadRecorder()
    outputs, grads, seen = {}, {}, {}
    for way, turns in (("here", learned_turns()), ("side by side", apply.Turns(enabled=False))):
        model = ThreadRecorder()
        model.load_state_dict(original.state_dict())
        dp = dpkit.DataParallel(model, DEVICES)
        dp.turns[True] = turns
        torch.manual_seed(1)  # the replicas' dropout generators are seeded from the default one
        outs = []
        for _ in range(3):
            out = dp(torch.ones(9, 6))
            out.sum().backward()
            outs.append(out.detach())
        outputs[way], grads[way] = outs, [p.grad for p in model.parameters()]
        seen[way] = {name for name, _ in model.seen}  # replicas share the original's list
    for a, b in zip(outputs["here"], outputs["side by side"]):
        assert torch.equal(a, b)
    assert (outputs["here"][0] == 0).any()  # dropout ran
    assert all(torch.equal(a, b) for a, b in zip(grads["here"], grads["side by side"]))
    assert seen["here"] == {threading.current_thread().name}
    assert seen["side by side"] == {f"dpkit-cpu:{i}_0" for i in range(len(DEVICES))}


def test_jobs_in_learned_turns_run_on_the_calling_thread_with_their_devices_share_of_threads():
    share = dpkit.devices.cpu_threads_per_device(len(DEVICES))
    before = torch.get_num_threads()
    turns = learned_turns()
    results = run_replicas(DEVICES, lambda i: (threading.current_thread(), torch.get_num_threads()), turns=turns)
    assert results == [(threading.current_thread(), share)] * len(DEVICES)
    assert torch.get_num_threads() == before  # the calling thread's own count is back
    sides = run_replicas(DEVICES, lambda i: threading.current_thread(), turns=apply.Turns(enabled=False))
    assert threading.current_thread() not in sides


def test_an_error_in_learned_turns_names_the_replica_and_device_and_the_runner_stays_usable():
    def job(i: int):
        if i == 1:
            raise ValueError("bad rows")
        return i

    with pytest.raises(ValueError, match="in replica 1 on device cpu:1: ValueError: bad rows"):
        run_replicas(DEVICES, job, turns=learned_turns())
    assert run_replicas(DEVICES, lambda i: i, turns=learned_turns()) == [0, 1, 2]


def test_jobs_that_wait_for_each_other_never_move_to_the_calling_thread():
    # a job that holds its turn while it waits for the others makes them time out: remembered, so the call
    # site keeps its worker threads (on the calling thread one after the other, they would never meet)
    barrier = threading.Barrier(len(DEVICES))
    turns = apply.Turns()
    for _ in range(turns.WARMUP + 2 * turns.SAMPLES + 2):
        assert run_replicas(DEVICES, lambda i: barrier.wait(timeout=30) >= 0 and i, turns=turns) == [0, 1, 2]
    assert turns.peers_waited and not turns.here()


def test_turns_are_measured_on_the_calling_thread_after_safe_runs_in_the_worker_threads():
    turns = apply.Turns()
    ran_in = []
    while turns.taking is None:
        run_replicas(DEVICES, lambda i: ran_in.append(threading.current_thread().name), turns=turns)
    here = threading.current_thread().name
    in_turns = [ran_in[k : k + 3] for k in range(0, len(ran_in), 3)][turns.WARMUP :: 2]  # runs alternate ways
    assert [set(names) == {here} for names in in_turns] == [False] * turns.SAFETY + [True] * turns.SAMPLES
    assert turns.clean_runs == turns.SAFETY and len(turns.seconds[True]) == turns.SAMPLES


@pytest.mark.parametrize("way", [True, False])
def test_turns_decided_runs_every_call_site_that_way_and_learns_nothing(way):
    turns = apply.Turns()
    here = threading.current_thread().name
    with apply.turns_decided(way):
        for _ in range(turns.WARMUP + 2 * (turns.SAMPLES + turns.SAFETY)):
            ran_in = run_replicas(DEVICES, lambda i: threading.current_thread().name, turns=turns)
            assert (set(ran_in) == {here}) is way  # in turns: on the calling thread at once; else the threads
    assert turns.runs == 0 and turns.taking is None  # nothing learned inside the block
    side = run_replicas(DEVICES, lambda i: threading.current_thread().name, turns=turns)
    assert here not in side  # after it, the call site learns as before (its first runs side by side)
