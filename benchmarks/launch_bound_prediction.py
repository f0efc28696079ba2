"""The cost model against measurement on virtual CPU devices: a launch-bound and a compute-bound example.

One `dpkit bench` run measures, in the same rounds (so that a shared machine's changing load hits every
configuration alike), the two examples of issue 21 at two or three global batches each:

    launch-bound   40 Linear(32, 32) + ReLU layers: a step is mostly operation launches
    wide-output    a small trunk and a 20,000-class head: a step is mostly arithmetic and memory passes

under single, dp, dp-balanced and replicated on 1 and 2 virtual CPU devices (one intra-op thread each, as
`dpkit bench` runs them). The cost model is calibrated on the first batch of each example and then predicts
every configuration of every batch; the other batches are what it did not see. Printed: measured and predicted
median step per configuration, the error, and whether the prediction gets the direction right (a multi-device
strategy slower or faster than single on one device).

    python benchmarks/launch_bound_prediction.py                     # batches 32/128 and 512/256/1024
    python benchmarks/launch_bound_prediction.py --steps 30 --out runs/predict   # keeps the bench JSONs

The bench JSONs it writes feed `dpkit plan --calibration`, e.g.

    dpkit plan --example launch-bound --calibration OUT/launch-bound-32.json \
        --calibration OUT/wide-output-512.json --batch-size 32 --device-counts 1,2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from dpkit.plan.calibration import BenchRun, calibrate, prediction_errors
from dpkit.tools.bench.run import run_benches
from dpkit.tools.bench.spec import BenchSpec

STRATEGIES = ["single", "dp", "dp-balanced", "replicated"]
EXAMPLES = {"launch-bound": (32, 128), "wide-output": (512, 256, 1024)}  # (calibration batch, unseen batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="measured steps per configuration (default 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", help="folder for the bench JSONs (default: a temporary one)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="dpkit-predict-"))
    out.mkdir(parents=True, exist_ok=True)
    specs, names = [], []
    for example, batches in EXAMPLES.items():
        for batch in batches:
            specs.append(
                BenchSpec(
                    example=example,
                    strategies=STRATEGIES,
                    device_counts=[1, 2],
                    batch_size=batch,
                    batch_size_per_device=None,
                    steps=args.steps,
                    warmup=args.warmup,
                    observed_steps=0,
                    optimizer="sgd",
                    accelerator="cpu",
                    progress=False,
                )
            )
            names.append(f"{example}-{batch}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"measuring {len(specs)} benches in the same rounds (load average {load:.2f}) ...")
    results = run_benches(specs)
    paths = {name: result.save_json(out / f"{name}.json") for name, result in zip(names, results)}
    calibration_names = [f"{example}-{batches[0]}" for example, batches in EXAMPLES.items()]
    first = BenchRun.load(paths[calibration_names[0]], "relative")
    runs = {name: BenchRun.load(path, "relative", first.reference_seconds) for name, path in paths.items()}
    calibration = calibrate([runs[name] for name in calibration_names])
    print(f"calibrated on {', '.join(calibration_names)}: fitted within {calibration.median_abs_error:.0%} (median)")
    print("  " + ", ".join(f"{name} {value:.3g}" for name, value in calibration.values.items()))
    errors_seen, errors_unseen, wrong = [], [], []
    header = (
        f"{'bench':<18} {'strategy':<12} {'dev':>3} {'measured ms':>12} {'predicted ms':>13} {'error':>7}  direction"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for name, run in runs.items():
        rows = prediction_errors(calibration, run, correct_load=False)
        single = next((m, p) for s, n, p, m in rows if n == 1 and s == "single")
        for strategy, devices, predicted, measured in rows:
            error = predicted / measured - 1
            (errors_seen if name in calibration_names else errors_unseen).append(abs(error))
            direction = ""
            if devices > 1:
                measured_faster = measured < single[0]
                predicted_faster = predicted < single[1]
                direction = f"{'faster' if measured_faster else 'slower'} than single"
                direction += ", right" if measured_faster == predicted_faster else ", WRONG"
                if measured_faster != predicted_faster:
                    wrong.append(f"{name} {strategy}")
            print(
                f"{name:<18} {strategy:<12} {devices:>3} {measured * 1e3:>12.2f} {predicted * 1e3:>13.2f} "
                f"{error:>+7.0%}  {direction}"
            )
    print(
        f"\nmedian absolute error: {statistics.median(errors_seen):.0%} on the calibration benches, "
        f"{statistics.median(errors_unseen):.0%} on the unseen batches; "
        f"directions wrong: {', '.join(wrong) if wrong else 'none'}"
    )
    print(f"bench JSONs in {out}")


if __name__ == "__main__":
    main()
