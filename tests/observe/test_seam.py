"""The observation seam: what DataParallel and the strategies announce, and how an Observer takes phases
arriving from any thread, with a device or without."""

import contextlib
import gc
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpkit
from dpkit.observe import Observer
from dpkit.parallel import hooks
from dpkit.parallel.apply import worker_for


class Recorder:
    """A listener that writes down every call, with the thread it came from."""

    def __init__(self):
        self.events = []
        self.lock = threading.Lock()

    def _note(self, *event):
        with self.lock:
            self.events.append(event + (threading.current_thread().name,))

    @contextlib.contextmanager
    def phase(self, name, device):
        self._note("phase", name, None if device is None else str(device))
        yield

    @contextlib.contextmanager
    def replica(self, index, device):
        self._note("replica", index, str(device))
        yield

    @contextlib.contextmanager
    def replica_phase(self, name):
        self._note("replica_phase", name)
        yield

    def split(self, module, devices, output_device, rows):
        self._note("split", [str(d) for d in devices], list(rows))

    def outputs(self, outputs, devices, stop):
        self._note("outputs", len(outputs), [str(d) for d in devices])


def test_a_listener_sees_every_phase_of_a_data_parallel_call():
    dp = dpkit.DataParallel(nn.Linear(3, 2), dpkit.cpu_devices(3), loss_fn=F.mse_loss)
    recorder = Recorder()
    with hooks.listening_to(recorder):
        dp(torch.randn(7, 3), target=torch.randn(7, 2))
    events = [e[:-1] for e in recorder.events]
    assert events[0] == ("split", ["cpu:0", "cpu:1", "cpu:2"], [3, 2, 2])
    assert events[1] == ("phase", "scatter", None)
    replicated = [e for e in events if e[1] == "replicate"]  # each device's, in one part or more
    assert list(dict.fromkeys(replicated)) == [("phase", "replicate", f"cpu:{i}") for i in range(3)]
    replicas = {(e[1], e[2], thread) for *e, thread in recorder.events if e[0] == "replica"}
    assert {(i, d) for i, d, _ in replicas} == {(0, "cpu:0"), (1, "cpu:1"), (2, "cpu:2")}
    assert all(thread.startswith(f"dpkit-{d}") for _, d, thread in replicas)  # in each device's own thread
    assert sum(1 for e in events if e == ("replica_phase", "loss")) == 3  # the loss inside every replica
    assert ("outputs", 3, ["cpu:0", "cpu:1", "cpu:2"]) in events
    assert events[-1] == ("phase", "loss", "cpu:0")  # the replicas' losses combined on the output device
    recorder.events.clear()
    dp(torch.randn(7, 3), target=torch.randn(7, 2))
    assert recorder.events == []  # removed: nothing announced to it any more


def test_an_observer_listens_only_while_started():
    # an observer an earlier test in this process left to garbage collection (dp-balanced's calibration) stops
    # when collected; what this observer adds and takes away is compared with what listened before it
    gc.collect()
    before = hooks.listeners()
    observer = Observer("cpu:0")
    assert observer not in before
    with observer:
        assert observer in hooks.listeners() and hooks.listening()
    assert hooks.listeners() == before and hooks.listening() == bool(before)


def test_phases_from_a_strategy_land_on_the_right_device_from_any_thread():
    with Observer("cpu:0") as obs:
        with hooks.phase("all_reduce"):  # no device, calling thread: the home device
            home_buffer = torch.empty(100, dtype=torch.float32)

        def replica_job():
            with hooks.replica(2, torch.device("cpu", 2)):
                with hooks.phase("backward"):  # no device inside a replica's job: the replica's own
                    grads = torch.empty(50, dtype=torch.float64)
                with hooks.phase("all_reduce", "cpu:2"):
                    time.sleep(0.01)
                with hooks.replica_phase("optimizer"):
                    state = torch.empty(25, dtype=torch.float64)
            return grads, state

        grads, state = worker_for(torch.device("cpu", 2)).submit(replica_job).result()
        launched = time.perf_counter()
        hooks.span("all_reduce", torch.device("cpu", 1), launched, 0.004, hidden_seconds=0.003)
    report = obs.report()
    assert report.device("cpu:0").peak_bytes_by_category["gradients"] == 400  # all_reduce's category
    cpu2 = report.device("cpu:2")
    assert cpu2.peak_bytes_by_category["gradients"] == 400
    assert cpu2.peak_bytes_by_category["optimizer_state"] == 200
    assert cpu2.seconds_by_phase["all_reduce"] >= 0.009 and "backward" in cpu2.seconds_by_phase
    cpu1 = report.device("cpu:1")
    assert cpu1.seconds_by_phase["all_reduce"] == pytest.approx(0.004)
    assert cpu1.hidden_seconds_by_phase == {"all_reduce": pytest.approx(0.003)}
    del home_buffer, grads, state


def test_an_optimizer_is_timed_on_the_device_that_holds_its_parameters():
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (first, second)]
    with Observer("cpu:0", models=[(first, "cpu:0"), (second, "cpu:1")]) as obs:
        for model, optimizer in zip((first, second), optimizers):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
    report = obs.report()
    assert "optimizer" in report.device("cpu:0").seconds_by_phase
    assert "optimizer" in report.device("cpu:1").seconds_by_phase


def test_a_replica_phase_must_be_a_known_phase():
    with (
        Observer("cpu:0"),
        pytest.raises(ValueError, match="replica_phase: unknown phase 'fwd'"),
        hooks.replica_phase("fwd"),
    ):
        pass


@pytest.mark.parametrize("strategy, devices", [("single", 1), ("dp", 2)])
def test_the_engine_announces_forward_loss_backward_and_optimizer(strategy, devices):
    engine = dpkit.Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False)
    bare = nn.Linear(3, 2)
    model, optimizer = engine.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
    criterion = engine.setup_criterion(F.mse_loss)
    recorder = Recorder()
    with hooks.listening_to(recorder), Observer("cpu:0", models=engine.model_copies()) as obs:
        loss = criterion(model(torch.randn(6, 3)), torch.randn(6, 2))
        engine.backward(loss)
        optimizer.step()
    phases = [(e[1], e[2]) for e in recorder.events if e[0] == "phase"]
    assert ("loss", "cpu:0") in phases and ("backward", "cpu:0") in phases
    splits = [e[1:3] for e in recorder.events if e[0] == "split"]
    assert splits == [([f"cpu:{i}" for i in range(devices)], dpkit.split_sizes(6, devices))]
    if strategy == "single":
        assert ("forward", "cpu:0") in phases  # dp's replicas announce their own forward
    report = obs.report()
    assert report.steps == 1 and [d.rows for d in report.devices] == dpkit.split_sizes(6, devices)
    assert {"forward", "loss", "backward", "optimizer"} <= set(report.device("cpu:0").seconds_by_phase)
