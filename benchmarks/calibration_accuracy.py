"""How well a calibrated plan predicts another bench run on this machine: calibrate on an MLP of width 512
at 256 rows per device, predict one of width 1024 at 96 rows per device (single, dp, dp-balanced and replicated
on 1, 2 and 3 virtual CPU devices), and print each prediction against its measurement and the median error.

The two benches take turns in the same rounds, and every step is taken relative to the reference work of its
round, so load that comes and goes touches both alike. The target is a median error within 15% on an idle
machine; a busy one can miss it, which is why this is a benchmark and not a test. tests/plan/test_calibration.py
checks the same calibration on two bench files recorded by this script (`--record tests/plan/data`).

    .venv/bin/python benchmarks/calibration_accuracy.py [--record FOLDER]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from dpkit.plan.calibration import BenchRun, calibrate, prediction_errors
from dpkit.tools.bench.run import run_benches
from dpkit.tools.bench.spec import BenchSpec

STRATEGIES = ["single", "dp", "dp-balanced", "replicated"]  # one process each: no launches
TARGET = 0.15


# the MLPs of widths 512 and 1024 that the plan tests use (tests/plan/widths.py), imported by name by the bench
WIDTHS = Path(__file__).resolve().parents[1] / "tests" / "plan"


def median_error(narrow_json: Path, wide_json: Path) -> tuple[float, str]:
    """The median |predicted / measured - 1| over the wide run's configurations, and a line per configuration."""
    first = BenchRun.load(narrow_json, "relative")
    second = BenchRun.load(wide_json, "relative", first.reference_seconds)
    compared = prediction_errors(calibrate(first), second, correct_load=False)
    errors = [abs(predicted / measured - 1) for _, _, predicted, measured in compared]
    lines = "\n".join(
        f"  {strategy:<12} x{devices}  predicted {predicted * 1e3:7.1f} ms  measured {measured * 1e3:7.1f} ms  "
        f"{predicted / measured - 1:+.0%}"
        for strategy, devices, predicted, measured in compared
    )
    return statistics.median(errors), lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, help="keep the two bench JSONs in this folder")
    args = parser.parse_args()
    sys.path.insert(0, str(WIDTHS))

    def spec(factory: str, batch: int) -> BenchSpec:
        return BenchSpec(
            example=None,
            model=f"widths:{factory}",
            input_shape=(64,),
            strategies=STRATEGIES,
            device_counts=[1, 2, 3],
            batch_size_per_device=batch,
            steps=16,
            warmup=3,
            observed_steps=0,
            progress=False,
        )

    with tempfile.TemporaryDirectory() as scratch:
        folder = args.record or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        narrow_run, wide_run = run_benches([spec("narrow", 256), spec("wide", 96)])
        narrow_run.save_json(folder / "narrow.json")
        wide_run.save_json(folder / "wide.json")
        error, lines = median_error(folder / "narrow.json", folder / "wide.json")
    print("calibrated on width 512 x 256 rows, predicting width 1024 x 96 rows:")
    print(lines)
    verdict = "within" if error <= TARGET else "OUTSIDE"
    print(f"median absolute error {error:.1%}: {verdict} the {TARGET:.0%} target")


if __name__ == "__main__":
    main()
