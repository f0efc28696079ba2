"""CPU memory accounting against known tensor sizes: right device, right category, gone when freed."""

import gc
import importlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import dpkit
from dpkit.observe import CATEGORIES, Observer, active
from dpkit.parallel import hooks
from dpkit.parallel.apply import worker_for

MIB = 1024 * 1024


def current(observer, device, category):
    return observer.ledger.accounts[device].current[category] if device in observer.ledger.accounts else 0


def test_calling_thread_allocation_lands_on_the_phase_device_and_leaves_when_freed():
    with Observer("cpu:0") as obs:
        with obs.phase("gather", "cpu:2"):
            t = torch.empty(1000, dtype=torch.float64)  # 8000 bytes
        assert current(obs, "cpu:2", "gathered_outputs") == 8000
        assert current(obs, "cpu:0", "gathered_outputs") == 0
        view = t.view(10, 100)[:5]  # views and in-place ops allocate nothing
        view.add_(1)
        assert obs.ledger.accounts["cpu:2"].total == 8000
        del t
        assert current(obs, "cpu:2", "gathered_outputs") == 8000  # the view still holds the storage
        del view
        gc.collect()
        assert current(obs, "cpu:2", "gathered_outputs") == 0
        outside_phase = torch.ones(250, dtype=torch.float32)  # 1000 bytes, home device, "other"
        assert current(obs, "cpu:0", "other") == 1000
    report = obs.report()
    assert report.device("cpu:2").peak_bytes == 8000
    assert report.device("cpu:2").bytes_by_category["gathered_outputs"] == 8000
    assert report.device("cpu:0").peak_bytes == 1000
    del outside_phase


def test_replica_thread_allocation_is_charged_to_its_device():
    device = torch.device("cpu", 3)

    def work():
        with obs.replica(3, device):
            kept = torch.zeros(4096, dtype=torch.float32)  # 16384 bytes, activations of cpu:3
            from dpkit.observe import replica_phase

            with replica_phase("loss"):
                loss_part = torch.zeros(16, dtype=torch.float64)  # 128 bytes, loss of cpu:3
            return kept, loss_part

    with Observer("cpu:0") as obs:
        kept, loss_part = worker_for(device).submit(work).result()
        assert current(obs, "cpu:3", "activations") == 16384
        assert current(obs, "cpu:3", "loss") == 128
        assert current(obs, "cpu:0", "activations") == 0
        del kept, loss_part
        assert obs.ledger.accounts["cpu:3"].total == 0
    assert obs.report().device("cpu:3").peak_bytes == 16384 + 128


def test_data_parallel_parameters_gradients_and_optimizer_state_by_device():
    torch.manual_seed(0)
    model = nn.Linear(256, 512).double()  # 131072 + 512 params
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dp = dpkit.DataParallel(model, dpkit.cpu_devices(2))
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(8, 256, dtype=torch.float64)
    output_bytes = 8 * 512 * 8
    with Observer(models=[model], optimizers=[optimizer]) as obs:
        assert current(obs, "cpu:0", "parameters") == param_bytes  # the originals, on the primary
        out = dp(x)
        assert current(obs, "cpu:0", "gathered_outputs") == output_bytes
        # cpu:1's peak so far: its replica's parameter copies and its half of the output, nothing else
        peak1 = obs.report().device("cpu:1")
        assert peak1.peak_bytes == param_bytes + output_bytes // 2
        assert peak1.bytes_by_category["parameters"] == param_bytes
        assert peak1.bytes_by_category["activations"] == output_bytes // 2
        with obs.phase("loss"):
            loss = out.square().mean()
        del out
        with obs.phase("backward"):
            loss.backward()
        # each replica computed its weight gradient on its own device; the reduced one lives on cpu:0
        assert obs.report().device("cpu:1").peak_bytes_by_category["gradients"] == param_bytes
        assert current(obs, "cpu:0", "gradients") == param_bytes
        # the kept replica holds the call's weight copy until the next call (a checkpoint recomputes on it)
        assert obs.ledger.accounts["cpu:1"].total == obs.ledger.accounts["cpu:1"].current["parameters"] == param_bytes
        optimizer.step()
        step_bytes = sum(s["step"].numel() * s["step"].element_size() for s in optimizer.state.values())
        # exp_avg and exp_avg_sq are seen as they are allocated; the 0-dim step counters are made
        # from Python data, which bypasses the dispatcher, and are charged when the observer meets them
        assert current(obs, "cpu:0", "optimizer_state") in (2 * param_bytes, 2 * param_bytes + step_bytes)
        obs.watch_optimizer(optimizer)
        assert current(obs, "cpu:0", "optimizer_state") == 2 * param_bytes + step_bytes
    report = obs.report()
    assert sum(report.device("cpu:0").bytes_by_category.values()) == report.device("cpu:0").peak_bytes
    assert set(report.device("cpu:0").bytes_by_category) == set(CATEGORIES)


def test_nothing_runs_when_no_observer_is_started(monkeypatch):
    assert active() == () and not hooks.listening()
    assert _get_current_dispatch_mode() is None
    replicate_calls = []
    data_parallel_module = importlib.import_module("dpkit.parallel.data_parallel")  # the attribute is torch's verb
    original = data_parallel_module.replicate
    monkeypatch.setattr(
        data_parallel_module,
        "replicate",
        lambda module, devices, primary: replicate_calls.append(list(devices)) or original(module, devices, primary),
    )
    dp = dpkit.DataParallel(nn.Linear(4, 4), dpkit.cpu_devices(2), cache_replicas=False)
    dp(torch.randn(4, 4))
    assert replicate_calls == [dpkit.cpu_devices(2)]  # all at once: no per-device phase for anyone to time
    with Observer():
        dp(torch.randn(4, 4))
    assert replicate_calls[1:] == [[torch.device("cpu", 0)], [torch.device("cpu", 1)]]
    assert active() == () and not hooks.listening() and _get_current_dispatch_mode() is None
    cached = dpkit.DataParallel(nn.Linear(4, 4), dpkit.cpu_devices(2))  # kept replicas: the same promise
    cached(torch.randn(4, 4))
    with Observer() as obs:
        cached(torch.randn(4, 4))
    assert all("replicate" in obs.report().device(d).seconds_by_phase for d in ("cpu:0", "cpu:1"))
    assert active() == () and not hooks.listening() and _get_current_dispatch_mode() is None


def test_observers_nest_and_stop_in_any_order():
    outer = Observer("cpu:0").start()
    inner = Observer("cpu:0").start()
    t = torch.empty(100, dtype=torch.float32)
    outer.stop()
    u = torch.empty(50, dtype=torch.float32)
    inner.stop()
    assert _get_current_dispatch_mode() is None
    assert outer.report().device("cpu:0").peak_bytes == 400
    assert inner.report().device("cpu:0").peak_bytes == 600
    del t, u


def test_unknown_phase_is_a_clear_error():
    with Observer() as obs, pytest.raises(ValueError, match="phase: unknown phase 'fwd'"), obs.phase("fwd"):
        pass


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_allocation_lands_on_its_device_and_the_peak_is_the_allocators():
    with Observer("cuda:0") as obs:
        with obs.phase("forward", "cuda:0"):
            t = torch.empty(1 << 20, dtype=torch.float32, device="cuda:0")  # 4 MiB
        assert current(obs, "cuda:0", "activations") == 4 << 20
        del t
        assert current(obs, "cuda:0", "activations") == 0
    report = obs.report().device("cuda:0")
    assert report.peak_bytes >= 4 << 20
    assert report.peak_bytes == torch.cuda.max_memory_allocated(0) or report.bytes_by_category["activations"] == 4 << 20
    assert report.seconds_by_phase["forward"] >= 0.0


def test_one_device_replica_runs_in_the_calling_thread_and_still_charges_activations():
    model = nn.Linear(16, 64).double()
    dp = dpkit.DataParallel(model, dpkit.cpu_devices(1))
    x = torch.randn(4, 16, dtype=torch.float64)
    with Observer(models=[model]) as obs:
        out = dp(x)
        assert obs.report().device("cpu:0").peak_bytes_by_category["activations"] == 4 * 64 * 8
        assert current(obs, "cpu:0", "gathered_outputs") == 4 * 64 * 8  # the replica's output, copied
        assert obs.report().device("cpu:0").peak_bytes_by_category["other"] == 0
    del out


def test_an_observer_stopped_from_another_thread_leaves_no_dispatch_mode_behind():
    """A finalizer may stop an observer in whatever thread garbage collection runs in; the calling thread's mode,
    which only that thread can exit, is exited at its next touch instead of left on its stack for good."""
    import threading

    observer = Observer(memory=True).start()
    assert _get_current_dispatch_mode() is not None
    errors = []

    def stop_elsewhere():
        try:
            observer.stop()
        except Exception as error:  # pragma: no cover - the failure this test exists for
            errors.append(error)

    thread = threading.Thread(target=stop_elsewhere)
    thread.start()
    thread.join()
    assert errors == []
    assert active() == () and _get_current_dispatch_mode() is None
