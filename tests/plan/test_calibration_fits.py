"""Calibration with the per-step terms: several bench runs fitted at once, global batches, the host constants
carried to GPUs, and the launch-bound / compute-bound directions that follow (no timing here: the "measured"
steps are the cost model's own under known constants, so the fit must find them again)."""

import json

import pytest
from machines import synthetic_bench

from dpkit.cli.main import main
from dpkit.examples import get_example
from dpkit.plan.calibration import HOST_CONSTANTS, BenchRun, calibrate
from dpkit.plan.catalogue import Catalogue
from dpkit.plan.configuration import Hardware, kernel_launch_seconds
from dpkit.plan.constants import CostConstants
from dpkit.plan.cost_model import predict
from dpkit.plan.profiles import measure_model

CATALOGUE = Catalogue.load()


def example_profile(name):
    example = get_example(name)
    x = example.load_data(0)[0]
    return measure_model(example.build_model, tuple(x.shape[1:]), input_dtype=x.dtype, name=name)


LAUNCH_BOUND = example_profile("launch-bound")
WIDE_OUTPUT = example_profile("wide-output")


def write(tmp_path, name, document):
    path = tmp_path / name
    path.write_text(json.dumps(document))
    return path


def test_two_runs_fitted_at_once_predict_unseen_batches_and_both_directions(tmp_path):
    launch = write(tmp_path, "launch-bound.json", synthetic_bench(LAUNCH_BOUND, 32))
    wide = write(tmp_path, "wide-output.json", synthetic_bench(WIDE_OUTPUT, 512))
    calibration = calibrate([launch, wide])
    assert calibration.median_abs_error < 0.03
    assert {"module_seconds", "tensor_seconds", "gil_share"} <= set(calibration.values)
    assert set(HOST_CONSTANTS) <= set(calibration.constants.fitted)
    for profile, batch in ((LAUNCH_BOUND, 128), (WIDE_OUTPUT, 2048)):
        unseen = BenchRun.from_dict(synthetic_bench(profile, batch))
        hardware, constants = calibration.for_hardware(None)
        for strategy, devices, measured in unseen.measured:
            predicted = unseen.predict_step(strategy, devices, hardware, constants)
            assert predicted == pytest.approx(measured, rel=0.05), (profile.name, strategy, devices)
    hardware, constants = calibration.for_hardware(None)

    def step(profile, strategy, devices, batch):
        share = -(-batch // devices)
        return predict(profile, hardware, strategy, devices, share, "32", constants, "sgd", batch).step_seconds

    # issue 21: on the launch-bound example DataParallel is slower than one device, on the compute-bound one a
    # one-process strategy with persistent replicas is faster (on two free cores)
    assert step(LAUNCH_BOUND, "dp", 2, 32) > 1.5 * step(LAUNCH_BOUND, "single", 1, 32)
    assert step(WIDE_OUTPUT, "replicated", 2, 2048) < 0.8 * step(WIDE_OUTPUT, "single", 1, 2048)


def test_a_global_batch_bench_is_read_per_configuration():
    run = BenchRun.from_dict(synthetic_bench(LAUNCH_BOUND, 33))
    assert run.batch_size == 33 and run.share(1) == 33 and run.share(2) == 17
    fitted = calibrate(run)
    assert fitted.median_abs_error < 0.05


def test_runs_of_cpus_and_gpus_are_not_fitted_together(tmp_path):
    gpu = synthetic_bench(LAUNCH_BOUND, 32)
    gpu["machine"]["accelerator"] = "cuda"
    cpu = synthetic_bench(LAUNCH_BOUND, 32)
    with pytest.raises(ValueError, match="calibration: the bench runs mix virtual CPU devices and GPUs"):
        calibrate([BenchRun.from_dict(cpu), BenchRun.from_dict(gpu)])


def test_the_host_constants_carry_over_to_gpus_and_win_over_the_catalogue():
    calibration = calibrate(BenchRun.from_dict(synthetic_bench(LAUNCH_BOUND, 32)))
    a100 = Hardware(CATALOGUE.gpu("a100-80gb-sxm"), CATALOGUE.link("nvlink3"))
    _, constants = calibration.for_hardware(a100)
    for name in HOST_CONSTANTS:
        assert getattr(constants, name) == pytest.approx(calibration.values[name])
    assert kernel_launch_seconds(a100, constants) == pytest.approx(calibration.values["launch_seconds"])
    # without a calibration a GPU of the catalogue launches at its own figure
    own = CATALOGUE.gpu("a100-80gb-sxm").launch_seconds
    assert own is not None
    assert kernel_launch_seconds(a100, CostConstants(launch_seconds=1.0)) == own


def test_plan_fits_several_calibrations_and_says_dp_loses_on_the_launch_bound_example(tmp_path, capsys):
    launch = write(tmp_path, "lb.json", synthetic_bench(LAUNCH_BOUND, 32))
    wide = write(tmp_path, "wo.json", synthetic_bench(WIDE_OUTPUT, 512))
    common = ["--calibration", str(launch), "--calibration", str(wide), "--device-counts", "1,2", "--optimizer", "sgd"]
    out = tmp_path / "plan.json"
    assert main(["plan", "--example", "launch-bound", "--batch-size", "32", *common, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "calibrated on" in text and "lb.json" in text and "wo.json" in text
    data = json.loads(out.read_text())
    step = {(p["strategy"], p["devices"]): p["step_seconds"] for p in data["predictions"]}
    assert step[("dp", 2)] > step[("single", 1)]
    assert data["recommendation"]["strategy"] == "single"
    assert "mostly operation launches" in data["recommendation"]["reasons"][0]
    assert main(["plan", "--example", "wide-output", "--batch-size", "2048", *common, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    step = {(p["strategy"], p["devices"]): p["step_seconds"] for p in data["predictions"]}
    assert step[("replicated", 2)] < step[("single", 1)]
    assert data["recommendation"]["devices"] == 2


def test_plan_takes_one_model(capsys):
    code = main(["plan", "--example", "launch-bound", "--model", "gpt2-124m", "--gpu", "t4", "--batch-size", "8"])
    assert code == 2
    assert "--example/--model: give one model" in capsys.readouterr().err
