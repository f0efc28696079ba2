"""Calibrate on one bench run; the plan then predicts a second run (other batch size, other width)."""

import statistics
import sys
from pathlib import Path

import pytest

from dpkit.bench import BenchSpec, run_bench
from dpkit.plan.calibration import BenchRun, calibrate, prediction_errors

sys.path.insert(0, str(Path(__file__).parent))  # the width factories, by module name

STRATEGIES = ["single", "dp", "dp-balanced", "replicated"]  # in one process: no launches, so seconds


def bench(tmp_path, factory: str, batch: int, reference_seconds: float | None = None) -> BenchRun:
    spec = BenchSpec(example=None, model=f"widths:{factory}", input_shape=(64,), strategies=STRATEGIES, device_counts=[1, 2, 3],
                     batch_size_per_device=batch, steps=16, warmup=3, observed_steps=0, progress=False)
    path = run_bench(spec).save_json(tmp_path / f"{factory}.json")
    # this machine is shared with other work: each step is taken relative to the reference work timed in
    # its round, in units of the first run's reference, so the load of the moment cancels out
    return BenchRun.load(path, statistic="relative", reference_seconds=reference_seconds)


def test_calibrated_plan_predicts_another_bench_within_15_percent(tmp_path):
    first = bench(tmp_path, "narrow", 256)
    second = bench(tmp_path, "wide", 96, reference_seconds=first.reference_seconds)
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
