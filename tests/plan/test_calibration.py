"""Calibrate on one bench run; the plan then predicts a second run (other batch size, other width).

The two runs are bench files recorded on an idle 2-core machine by benchmarks/calibration_accuracy.py, which
measures the same thing live: a test that timed this machine would fail whenever other work shares it.
"""

import statistics
from pathlib import Path

import pytest

from dpkit.plan.calibration import BenchRun, calibrate, prediction_errors

RECORDED = Path(__file__).parent / "data"


def test_calibrated_plan_predicts_another_bench_within_15_percent():
    # each step relative to the reference work of its round: a burst of load that stretched some rounds
    # cancels out of the medians
    first = BenchRun.load(RECORDED / "narrow.json", "relative")
    second = BenchRun.load(RECORDED / "wide.json", "relative", first.reference_seconds)
    calibration = calibrate(first)
    compared = prediction_errors(calibration, second, correct_load=False)
    errors = [abs(predicted / measured - 1) for _, _, predicted, measured in compared]
    report = ", ".join(f"{s}x{n} {p * 1e3:.1f}/{m * 1e3:.1f} ms" for s, n, p, m in compared)
    assert len(errors) == 10
    assert statistics.median(errors) <= 0.15, report


def test_calibration_rejects_a_file_that_is_not_a_bench(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"predictions": []}')
    with pytest.raises(ValueError, match="not a dpkit bench JSON"):
        calibrate(path)
    with pytest.raises(FileNotFoundError, match="dpkit bench --json"):
        calibrate(tmp_path / "missing.json")
