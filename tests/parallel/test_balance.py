"""balance="memory" / "speed": the solver, the calibration, limits, exactness, no replica without rows."""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import dpkit
from dpkit.examples.wide_output import WideOutputNet
from dpkit.observe import Observer
from dpkit.observe.measured_balance import Balancer
from dpkit.observe.report import DeviceReport, Report
from dpkit.parallel import hooks
from dpkit.parallel.balance import CALIBRATION_CALLS, LinearCost, fill_rows, fit_linear, solve, spread_within_slack

# dpkit.parallel.data_parallel is the function, as in torch; this is the module
CLASSES, HIDDEN, BATCH = 20_000, 32, 256


# ---- the solver -------------------------------------------------------------------------------------
def test_equal_costs_give_the_even_split():
    assert sorted(fill_rows(10, LinearCost((5.0,) * 4, (2.0,) * 4))) == [2, 2, 3, 3]


def test_device_zero_with_more_fixed_memory_gets_fewer_rows_and_peaks_equalise():
    cost = LinearCost((100.0, 20.0, 20.0, 20.0), (1.0, 1.0, 1.0, 1.0))
    rows = fill_rows(320, cost)
    assert rows == [20, 100, 100, 100]
    assert max(cost.predict(rows)) == min(cost.predict(rows)) == 120.0
    assert fill_rows(200, cost) == [0, 66, 67, 67]  # device 0's own share already costs more than the rest


def test_rows_never_exceed_a_device_cap_and_an_impossible_batch_is_a_clear_error():
    cost = LinearCost((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    assert fill_rows(30, cost, max_rows=[30, 2, 30]) == [14, 2, 14]
    with pytest.raises(ValueError, match="max_bytes_per_device: the devices can hold at most 12 rows"):
        fill_rows(13, cost, max_rows=[5, 2, 5])


def test_fit_recovers_lines_and_borrows_a_slope_for_an_unchanged_device():
    points = [[(10, 150.0), (20, 250.0)], [(10, 30.0), (15, 45.0)], [(10, 30.0), (10, 30.0)]]
    cost = fit_linear(points)
    assert cost.fixed[:2] == pytest.approx((50.0, 0.0))
    assert cost.per_row[:2] == pytest.approx((10.0, 3.0))
    assert cost.per_row[2] in (pytest.approx(10.0), pytest.approx(3.0))  # a fitted device's slope


def test_calibration_sequence_and_re_solving_for_a_new_batch_size():
    balancer = Balancer("memory", ["cpu:0", "cpu:1"])
    assert balancer.plan(8, can_measure=False) == ([4, 4], False)
    assert balancer.plan(8) == ([4, 4], True)  # warm-up, observed only to learn the optimizers
    balancer.record([4, 4], [999, 999])
    assert balancer.plan(8) == ([4, 4], True)
    balancer.record([4, 4], [4 * 10 + 100, 4 * 10 + 20])
    sizes, measure = balancer.plan(8)
    assert measure and sizes[0] < 4 and sum(sizes) == 8
    balancer.record(sizes, [s * 10 + f for s, f in zip(sizes, (100, 20))])
    assert balancer.calibration_calls == CALIBRATION_CALLS["memory"]
    assert balancer.plan(8) == ([0, 8], False)  # 100 + 0 vs 20 + 80
    assert balancer.plan(20) == ([6, 14], False)  # 160 vs 160, solved again without measuring


def test_the_solver_takes_numbers_and_gives_rows():
    cost = LinearCost((100.0, 20.0), (10.0, 10.0))
    assert solve("memory", 20, cost, [None, None]) == [6, 14]
    assert solve("memory", 20, cost, [None, 20.0 + 10.0 * 10]) == [10, 10]  # cpu:1 holds at most 10 rows
    assert solve("speed", 12, LinearCost((0.0, 0.0), (0.2, 0.1)), [None, None]) == [4, 8]


def test_a_report_becomes_one_number_per_device():
    report = fake_report([300, 100], seconds=[0.5, 0.25])
    assert Balancer("memory", ["cpu:0", "cpu:1"]).values_from([3, 5], report) == [300.0, 100.0]
    assert Balancer("speed", ["cpu:0", "cpu:1", "cpu:2"]).values_from([3, 0, 5], report) == [0.5, None, None]


def test_speed_gives_rows_in_proportion_to_throughput():
    balancer = Balancer("speed", ["cpu:0", "cpu:1"])
    balancer.plan(12)
    balancer.record([6, 6], [1.0, 1.0])  # warm-up: ignored
    assert balancer.plan(12) == ([6, 6], True)
    balancer.record([6, 6], [1.2, 0.6])  # cpu:1 is twice as fast
    assert balancer.plan(12) == ([4, 8], False)


def test_one_device_needs_no_balance():
    balancer = Balancer("memory", ["cpu:0"])
    assert balancer.plan(7) == ([7], False)


def fake_report(peaks, seconds=None):
    seconds = seconds or [0.0] * len(peaks)
    return Report(
        [DeviceReport(f"cpu:{i}", None, peak, {}, {"forward": s}) for i, (peak, s) in enumerate(zip(peaks, seconds))]
    )


# ---- DataParallel(balance="memory") on the wide-output model ------------------------------------------
def wide_model():
    torch.manual_seed(0)
    return WideOutputNet(hidden=HIDDEN, classes=CLASSES).double()


def batch(rows=BATCH, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 64, generator=generator, dtype=torch.float64), torch.randint(
        0, CLASSES, (rows,), generator=generator
    )


def calibrate(dp, steps=4, rows=BATCH):
    """Train steps (warm-up, even, perturbed; the balanced split is chosen at the 4th call) with Adam at
    lr=0: device 0 alone holds its state, and the parameters stay put for an exact comparison."""
    optimizer = torch.optim.Adam(dp.parameters(), lr=0.0)
    for step in range(steps):
        x, y = batch(rows, seed=step)
        optimizer.zero_grad(set_to_none=True)
        dp(x, target=y).backward()
        optimizer.step()
    dp.finish_measurement()
    return optimizer


def test_balanced_split_keeps_loss_and_every_gradient_exact_and_evens_the_peaks():
    model = wide_model()
    reference = copy.deepcopy(model)
    dp = dpkit.DataParallel(model, dpkit.cpu_devices(4), loss_fn=F.cross_entropy, balance="memory")
    optimizer = calibrate(dp)
    x, y = batch(seed=10)
    optimizer.zero_grad(set_to_none=True)
    with Observer(models=[model], optimizers=[optimizer]) as obs:
        loss = dp(x, target=y)
        with obs.phase("backward"):
            loss.backward()
        gradients = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    sizes = dp.last_split_sizes
    assert sum(sizes) == BATCH and sizes[0] < min(sizes[1:])  # device 0 pays for what it alone holds
    assert obs.report().imbalance <= 1.10
    expected = F.cross_entropy(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-12, atol=1e-12)
    for gradient, expected_param in zip(gradients, reference.parameters()):
        torch.testing.assert_close(gradient, expected_param.grad, rtol=1e-10, atol=1e-12)


def test_a_device_limit_is_never_exceeded_and_a_device_that_holds_nothing_gets_no_replica():
    free = dpkit.DataParallel(wide_model(), dpkit.cpu_devices(3), loss_fn=F.cross_entropy, balance="memory")
    calibrate(free)
    cost, free_sizes = free.balancer.cost, free.balancer.plan(BATCH)[0]
    # cpu:2 may only hold half its unconstrained share; cpu:1 cannot even hold its parameter copies
    limit = cost.fixed[2] + cost.per_row[2] * (free_sizes[2] // 2)
    limits = [None, cost.fixed[1] * 0.5, limit]
    model = wide_model()
    dp = dpkit.DataParallel(
        model, dpkit.cpu_devices(3), loss_fn=F.cross_entropy, balance="memory", max_bytes_per_device=limits
    )
    optimizer = calibrate(dp)
    x, y = batch(seed=11)
    optimizer.zero_grad(set_to_none=True)
    with hooks.listening_to(ReplicateRecorder()) as recorder, Observer(models=[model], optimizers=[optimizer]) as obs:
        dp(x, target=y).backward()
        optimizer.step()
    sizes = dp.last_split_sizes
    assert sizes[1] == 0 and 0 < sizes[2] <= free_sizes[2] // 2 and sum(sizes) == BATCH
    assert recorder.devices == ["cpu:0", "cpu:2"] and torch.device("cpu", 1) not in dp.last_devices
    assert obs.report().device("cpu:2").peak_bytes <= limit


class ReplicateRecorder:
    """A seam listener: the devices a replica was made for, in order (DataParallel announces each one's
    "replicate", once or in parts)."""

    def __init__(self):
        self.seen = {}

    @property
    def devices(self):
        return list(self.seen)

    @contextlib.contextmanager
    def phase(self, name, device):
        if name == "replicate":
            self.seen[str(device)] = True
        yield


@pytest.mark.parametrize("cache_replicas", [True, False])
def test_zero_row_chunk_is_not_replicated(cache_replicas):
    dp = dpkit.DataParallel(
        torch.nn.Linear(3, 2), dpkit.cpu_devices(3), chunk_sizes=[2, 0, 2], cache_replicas=cache_replicas
    )
    with hooks.listening_to(ReplicateRecorder()) as recorder:
        assert dp(torch.randn(4, 3)).shape == (4, 2)
    assert recorder.devices == ["cpu:0", "cpu:2"]


def test_impossible_limits_are_a_clear_error():
    dp = dpkit.DataParallel(
        wide_model(),
        dpkit.cpu_devices(2),
        loss_fn=F.cross_entropy,
        balance="memory",
        max_bytes_per_device=4 * 1024 * 1024,
    )
    with pytest.raises(ValueError, match="max_bytes_per_device"):
        calibrate(dp, steps=5)


def test_balance_arguments_are_checked():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="balance: expected 'memory', 'speed' or None"):
        dpkit.DataParallel(model, dpkit.cpu_devices(2), balance="fast")
    with pytest.raises(ValueError, match="balance and chunk_sizes"):
        dpkit.DataParallel(model, dpkit.cpu_devices(2), balance="memory", chunk_sizes=[1, 1])
    with pytest.raises(ValueError, match="max_bytes_per_device: has 3 entries for 2 devices"):
        dpkit.DataParallel(model, dpkit.cpu_devices(2), balance="memory", max_bytes_per_device=[1, 2, 3])


def test_one_device_with_balance_runs_without_measuring():
    dp = dpkit.DataParallel(torch.nn.Linear(3, 2), dpkit.cpu_devices(1), loss_fn=F.mse_loss, balance="memory")
    for _ in range(3):
        dp(torch.randn(5, 3), target=torch.randn(5, 2)).backward()
    assert dp.last_split_sizes == [5] and dp.balancer.measured_steps == 0


class SlowOnCpu1(torch.nn.Module):
    """Sleeps per row, three times longer in cpu:1's worker thread: a slower device."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x):
        import threading
        import time

        slow = threading.current_thread().name.startswith("dpkit-cpu:1")
        time.sleep(len(x) * 0.001 * (3 if slow else 1))
        return self.linear(x)


def test_speed_balance_gives_the_slower_device_fewer_rows():
    # the slowness is the thread's: the replicas run in their device threads
    dp = dpkit.DataParallel(
        SlowOnCpu1(), dpkit.cpu_devices(2), loss_fn=F.mse_loss, balance="speed", concurrency="threads"
    )
    for _ in range(3):  # warm-up, one measured step, then balanced
        dp(torch.randn(40, 3), target=torch.randn(40, 1)).backward()
    fast, slow = dp.last_split_sizes
    assert fast + slow == 40 and 25 <= fast <= 35  # about 3:1


def test_a_wrapper_dropped_while_measuring_leaves_nothing_running():
    import gc

    from torch.utils._python_dispatch import _get_current_dispatch_mode

    gc.collect()  # a wrapper an earlier test of this worker dropped in a reference cycle stops its observer now
    assert dpkit.observe.active() == ()
    dp = dpkit.DataParallel(torch.nn.Linear(3, 2), dpkit.cpu_devices(2), loss_fn=F.mse_loss, balance="memory")
    dp(torch.randn(8, 3), target=torch.randn(8, 2)).backward()
    assert len(dpkit.observe.active()) == 1  # the warm-up step is being observed
    del dp
    assert dpkit.observe.active() == () and _get_current_dispatch_mode() is None


def test_a_dominant_device_zero_still_gets_rows_within_the_slack():
    # device 0's own state (1000) outweighs the others' whole share: the strict optimum leaves it idle
    cost = LinearCost((1000.0, 100.0, 100.0), (1.0, 1.0, 1.0))
    strict = fill_rows(60, cost)
    assert strict[0] == 0
    spread = spread_within_slack(strict, cost, [60, 60, 60], slack=0.03)
    assert spread == [20, 20, 20] and sum(spread) == 60
    assert max(cost.predict(spread)) <= max(cost.predict(strict)) * 1.03
    # with no room to spare, the strict split stands
    tight = LinearCost((1000.0, 100.0, 100.0), (100.0, 10.0, 10.0))
    rows = fill_rows(60, tight)
    assert spread_within_slack(rows, tight, [60, 60, 60], slack=0.03)[0] == 0


def test_one_data_parallel_measures_through_the_planner_plugged_into_the_seam(monkeypatch):
    from dpkit.observe.measured_balance import MeasuredBalance
    from dpkit.parallel.data_parallel import DataParallel as ParallelDataParallel

    assert dpkit.DataParallel is dpkit.parallel.DataParallel is ParallelDataParallel
    assert isinstance(
        ParallelDataParallel(torch.nn.Linear(3, 2), dpkit.cpu_devices(2), balance="memory").balancer, MeasuredBalance
    )
    monkeypatch.setattr(hooks, "_balance_planner", None)  # parallel/ alone measures nothing
    with pytest.raises(
        ValueError, match="balance: 'memory' needs a planner that measures steps and none is plugged in"
    ):
        ParallelDataParallel(torch.nn.Linear(3, 2), dpkit.cpu_devices(2), balance="memory")

    class FixedPlanner:  # the ChunkPlanner protocol: rows per call, finish() at the start of the next
        def __init__(self):
            self.asked, self.finished = [], 0

        def chunk_sizes(self, batch_size, can_measure):
            self.asked.append((batch_size, can_measure))
            return [1, batch_size - 1]

        def finish(self):
            self.finished += 1

    planner = FixedPlanner()
    dp = ParallelDataParallel(torch.nn.Linear(3, 2), dpkit.cpu_devices(2), balance="speed", planner=planner)
    dp(torch.randn(6, 3))
    with torch.no_grad():
        dp(torch.randn(4, 3))
    assert dp.last_split_sizes == [1, 3] and planner.asked == [(6, True), (4, False)] and planner.finished == 2
    with pytest.raises(ValueError, match="planner: chooses the rows for balance="):
        ParallelDataParallel(torch.nn.Linear(3, 2), dpkit.cpu_devices(2), planner=planner)
