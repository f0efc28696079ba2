"""Calibrate on one bench run; the plan then predicts a second run (other batch size, other width)."""

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from dpkit.plan.calibration import BenchRun, calibrate, prediction_errors

STRATEGIES = ["single", "dp", "dp-balanced", "replicated"]  # in one process: no launches, so seconds


BENCHES = """
import sys
from dpkit.tools.bench import BenchSpec, run_benches

STRATEGIES = sys.argv[3].split(",")


def spec(factory, batch):
    return BenchSpec(example=None, model=f"widths:{factory}", input_shape=(64,), strategies=STRATEGIES,
                     device_counts=[1, 2, 3], batch_size_per_device=batch, steps=16, warmup=3, observed_steps=0,
                     progress=False)

narrow, wide = run_benches([spec("narrow", 256), spec("wide", 96)])
narrow.save_json(sys.argv[1])
wide.save_json(sys.argv[2])
"""


def test_calibrated_plan_predicts_another_bench_within_15_percent(tmp_path):
    # the two benches take turns in the same rounds: this machine is shared with other work, and load
    # that changed between two runs made one after the other would move every step time of the second.
    # They run in a fresh process, away from whatever earlier tests left in this one (threads, hooks).
    narrow, wide = tmp_path / "narrow.json", tmp_path / "wide.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(
        [sys.executable, "-c", BENCHES, str(narrow), str(wide), ",".join(STRATEGIES)], env=env, check=True, timeout=240
    )
    # each step relative to the reference work of its round: a burst of load that stretched some rounds
    # cancels out of the medians
    first = BenchRun.load(narrow, "relative")
    second = BenchRun.load(wide, "relative", first.reference_seconds)
    calibration = calibrate(first)
    compared = prediction_errors(calibration, second, correct_load=False)
    errors = [abs(predicted / measured - 1) for _, _, predicted, measured in compared]
    report = ", ".join(f"{s}x{n} {p * 1e3:.1f}/{m * 1e3:.1f} ms" for s, n, p, m in compared)
    print(f"median absolute error {statistics.median(errors):.1%}: {report}")
    assert len(errors) == 10
    assert statistics.median(errors) <= 0.15, report


def test_calibration_rejects_a_file_that_is_not_a_bench(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"predictions": []}')
    with pytest.raises(ValueError, match="not a dpkit bench JSON"):
        calibrate(path)
    with pytest.raises(FileNotFoundError, match="dpkit bench --json"):
        calibrate(tmp_path / "missing.json")
