"""The cost model's per-step terms (issue 21): DataParallel re-making its replicas per module and per parameter
tensor, one process's replica threads serialised on the GIL, the catalogue's launch latency, and the batch from
which data parallelism pays."""

import json
from dataclasses import replace

import pytest
from machines import BUSY_2_CORES, cpu_calibration
from torch import nn

from dpkit.plan.catalogue import Catalogue
from dpkit.plan.configuration import Hardware
from dpkit.plan.constants import CostConstants
from dpkit.plan.cost_model import predict
from dpkit.plan.payoff import break_even_batch, speedup, speedup_curve
from dpkit.plan.profiles import given_profile, measure_model
from dpkit.plan.step_time import threaded_launch_seconds
from dpkit.strategies import ON_ROOT, ONE_PROCESS, PER_STEP, PERSISTENT, matching, reference

CATALOGUE = Catalogue.load()
A100 = Hardware(CATALOGUE.gpu("a100-80gb-sxm"), CATALOGUE.link("nvlink3"))
DP = matching(lambda t: t.replicas == PER_STEP and t.loss == ON_ROOT and not t.balances)[0]
REPLICATED = matching(lambda t: t.processes == ONE_PROCESS and t.replicas == PERSISTENT)[0]
# a model with almost no arithmetic: its step is launches and per-step work
TINY = replace(given_profile(4e4, 1e3, kernels_per_forward=100, output_bytes_per_sample=40.0), parameter_tensors=80)


def test_dp_remakes_every_replica_per_module_and_per_parameter_tensor():
    constants = CostConstants(module_seconds=1e-5, tensor_seconds=3e-6)
    few, many = replace(TINY, modules=10), replace(TINY, modules=110)
    for devices in (1, 2, 4):  # dpkit's DataParallel makes its one replica on one device too
        grown = [predict(p, A100, DP, devices, 8, constants=constants).breakdown["replicate"] for p in (few, many)]
        assert grown[1] - grown[0] == pytest.approx(devices * 100 * 1e-5)
    more_tensors = replace(few, parameter_tensors=180)
    base = predict(few, A100, DP, 2, 8, constants=constants).breakdown["replicate"]
    assert predict(more_tensors, A100, DP, 2, 8, constants=constants).breakdown["replicate"] - base == pytest.approx(
        2 * 100 * 3e-6
    )
    assert "replicate" not in predict(few, A100, REPLICATED, 2, 8, constants=constants).breakdown  # persistent


def test_replica_threads_share_the_gil_on_a_gpu_host():
    launch = 100 * CATALOGUE.gpu("a100-80gb-sxm").launch_seconds  # a forward's launches, no arithmetic to hide them
    for gil_share, expected in ((1.0, 2 * launch), (0.5, launch), (0.25, launch)):
        constants = CostConstants(gil_share=gil_share)
        assert threaded_launch_seconds(launch, 0.0, 2, 1.0, False, gil_share) == pytest.approx(expected)
        launched = predict(TINY, A100, REPLICATED, 2, 1, constants=constants).breakdown["launch"]
        assert launched == pytest.approx(expected, rel=1e-3)  # less the device's (tiny) forward
    # a device computing longer than the host launches hides them
    assert threaded_launch_seconds(launch, 10 * launch, 2, 1.0, False, 1.0) == 0.0


def test_on_shared_cores_threads_launch_no_faster_than_the_cores_allow():
    launch = 1e-3
    # one free core for two replica threads: their launches take turns, whatever the GIL
    assert threaded_launch_seconds(launch, 0.0, 2, 2.0, True, 0.1) == pytest.approx(2 * launch)
    # two free cores, a GIL held throughout: still in turn
    assert threaded_launch_seconds(launch, 0.0, 2, 1.0, True, 1.0) == pytest.approx(2 * launch)
    # contention (a share above 1): two threads slower than one after the other
    assert threaded_launch_seconds(launch, 0.0, 2, 1.0, True, 1.5) == pytest.approx(3 * launch)


def test_a_gpu_launches_at_the_catalogues_figure():
    slow = replace(A100, gpu=replace(A100.gpu, launch_seconds=50e-6))
    fast = predict(TINY, A100, reference(), 1, 8).breakdown
    slowed = predict(TINY, slow, reference(), 1, 8).breakdown
    assert slowed["backward"] > fast["backward"]  # a launch-bound backward waits for the host


def test_a_user_catalogue_sets_a_gpus_launch_latency(tmp_path):
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"gpus": {"t4": {"launch_seconds": 9e-6}}}))
    assert Catalogue.load(mine).gpu("t4").launch_seconds == 9e-6
    mine.write_text(json.dumps({"gpus": {"t4": {"launch_seconds": -1}}}))
    with pytest.raises(ValueError, match=r"gpus.t4.launch_seconds: expected a positive number"):
        Catalogue.load(mine)


def test_a_measured_profile_counts_the_modules_dataparallel_remakes():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    profile = measure_model(model, (4,))
    assert profile.modules == len(list(model.modules())) == 6
    assert replace(profile, modules=0).module_count == profile.parameter_tensors // 2 + 1  # estimated when unknown


def test_dp_pays_from_the_break_even_batch_on():
    hardware, constants = cpu_calibration().for_hardware(None)
    model = given_profile(
        1e5,
        1e6,
        kernels_per_forward=100,
        activation_bytes_per_sample=1e3,
        output_bytes_per_sample=40.0,
        input_bytes_per_sample=128.0,
    )
    pays = break_even_batch(model, hardware, REPLICATED, 2, constants=constants, optimizer="sgd")
    assert pays is not None and pays > 1
    assert speedup(model, hardware, REPLICATED, 2, pays, constants=constants, optimizer="sgd") >= 1
    assert speedup(model, hardware, REPLICATED, 2, pays - 1, constants=constants, optimizer="sgd") < 1
    curve = speedup_curve(model, hardware, REPLICATED, 2, [1, 16, 256, 4096], constants=constants, optimizer="sgd")
    gains = [gain for _, gain in curve]
    assert gains == sorted(gains)


def test_on_one_free_core_dp_never_pays_on_a_launch_bound_model():
    hardware, constants = cpu_calibration(BUSY_2_CORES, compute_slots=1.0).for_hardware(None)
    assert break_even_batch(TINY, hardware, DP, 2, constants=constants, optimizer="sgd", most=1 << 14) is None
    with pytest.raises(ValueError, match="devices: break-even compares several devices"):
        break_even_batch(TINY, hardware, DP, 1, constants=constants)
