"""The one replica runner: order, named errors, Ctrl-C and SystemExit at once, generators, parallel_apply."""

from __future__ import annotations

import _thread
import threading
import time

import pytest
import torch
from torch import nn

import dpkit
from closeness import intra_op_threads
from dpkit.devices import cpu_threads_per_device
from dpkit.parallel import apply, hooks, workers
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
        monkeypatch.setattr(workers, "ABANDONED_WAIT_SECONDS", 0.3)
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
    with intra_op_threads(cpu_threads_per_device(len(modules))):  # as each replica ran: the same kernels, bitwise
        expected = [module(x) for module, x in zip(modules, inputs)]
    assert all(torch.equal(out, want) for out, want in zip(outputs, expected))
    with pytest.raises(ValueError, match="inputs: has 1 entries for 2 modules"):
        parallel_apply(modules, inputs[:1])
    with pytest.raises(ValueError, match="kwargs_tup: has 1 entries"):
        parallel_apply(modules, inputs, [{}])
    with pytest.raises(ValueError, match="devices"):
        parallel_apply(modules, inputs, None, ["cpu:0", "cpu:0"])
