"""Where DataParallel starts to pay: the figure in docs/cost-model.md (docs/dp-pays-off.png), from the cost model.

The question is the user's: with this model and a global batch of B samples, is one step of dp on 2 devices
(B/2 each) shorter than one device's step on all B? Left: the predicted speed-up of dp on 2 GPUs over one GPU
against the global batch, for models from launch-bound to compute-bound, on one GPU and link; each curve's
break-even batch (where it crosses 1) is marked. Middle: that break-even batch for each model as the link between
the two GPUs changes (the GPU's compute kept). Right (with --cpu-calibration): the same for 2 virtual CPU devices
of the machine a bench ran on, dp and replicated on the launch-bound and wide-output examples.
Nothing runs on a device: these are predictions (dpkit.plan.payoff) from the catalogue's figures and the cost
model's default constants (GPUs), and from a calibration (CPU).

    python benchmarks/dp_pays_off.py --cpu-calibration lb.json --cpu-calibration wo.json   # docs/dp-pays-off.png
    python benchmarks/dp_pays_off.py --gpu rtx-3090 --link pcie4 --out /tmp/pays.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dpkit.examples import get_example
from dpkit.plan.calibration import calibrate
from dpkit.plan.catalogue import Catalogue
from dpkit.plan.configuration import Hardware
from dpkit.plan.constants import CostConstants
from dpkit.plan.payoff import break_even_batch, speedup_curve
from dpkit.plan.profiles import builtin_profile, measure_model
from dpkit.strategies import ON_ROOT, ONE_PROCESS, PER_STEP, PERSISTENT, matching

BATCHES = [2**k for k in range(1, 17)]
LINKS = ["pcie3", "pcie4", "pcie5", "nvlink-bridge", "nvlink3", "nvlink4"]
MOST = 1 << 16


def example_profile(name: str):
    example = get_example(name)
    x = example.load_data(0)[0]
    return measure_model(example.build_model, tuple(x.shape[1:]), input_dtype=x.dtype, name=name)


def models():
    """From launch-bound to compute-bound: (label, profile)."""
    return [
        ("launch-bound (40 Linear(32, 32))", example_profile("launch-bound")),
        ("launch-bound-conv (12 Conv2d(8, 8) on 8x8)", example_profile("launch-bound-conv")),
        ("wide-output (20,000 classes)", example_profile("wide-output")),
        ("resnet50 on 32x32 images", builtin_profile("resnet50", (3, 32, 32))),
        ("resnet50 on 224x224 images", builtin_profile("resnet50")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="a100-80gb-pcie")
    parser.add_argument("--link", default=None, help="default: the GPU's usual link")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument(
        "--cpu-calibration", action="append", help="a dpkit bench JSON of virtual CPU devices (repeatable)"
    )
    parser.add_argument("--out", default=str(Path(__file__).parents[1] / "docs" / "dp-pays-off.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    catalogue = Catalogue.load()
    gpu = catalogue.gpu(args.gpu)
    link = catalogue.link(args.link) if args.link else catalogue.usual_link(gpu)
    hardware = Hardware(gpu, link)
    constants = CostConstants()
    dp = matching(lambda t: t.processes == ONE_PROCESS and t.replicas == PER_STEP and t.loss == ON_ROOT)[0]
    persistent = matching(lambda t: t.processes == ONE_PROCESS and t.replicas == PERSISTENT)[0]
    panels = 3 if args.cpu_calibration else 2
    figure, axes = plt.subplots(1, panels, figsize=(6.2 * panels, 4.8))
    left, right = axes[0], axes[1]
    rows = []
    for label, profile in models():
        curve = speedup_curve(profile, hardware, dp, args.devices, BATCHES, "32", constants, "sgd", per_device=False)
        (line,) = left.plot([b for b, _ in curve], [s for _, s in curve], marker="o", markersize=3, label=label)
        pays = break_even_batch(profile, hardware, dp, args.devices, "32", constants, "sgd", False, MOST)
        if pays is not None:
            left.axvline(pays, color=line.get_color(), linestyle=":", linewidth=1)
        per_link = []
        for name in LINKS:
            other = Hardware(gpu, catalogue.link(name))
            per_link.append(break_even_batch(profile, other, dp, args.devices, "32", constants, "sgd", False, MOST))
        right.plot(
            range(len(LINKS)),
            [b if b is not None else float("nan") for b in per_link],
            marker="o",
            color=line.get_color(),
            label=label,
        )
        rows.append((label, pays, per_link))
    left.axhline(1.0, color="grey", linewidth=1)
    left.set_xscale("log", base=2)
    left.set_xlabel("global batch (samples per step, split across the GPUs)")
    left.set_ylabel(f"{dp} on {args.devices} GPUs / one GPU (samples/s, predicted)")
    left.set_title(f"{dp} pays above 1: 2x {gpu.name}, {link.name}; dotted: break-even", fontsize="medium")
    left.legend(fontsize="small")
    right.set_yscale("log", base=2)
    right.set_xticks(range(len(LINKS)), LINKS)
    right.set_xlabel(f"link between the {args.devices} GPUs ({gpu.name}'s compute)")
    right.set_ylabel("break-even global batch (predicted)")
    right.set_title(f"from which batch {dp} outruns one GPU (missing: not up to {MOST:,})", fontsize="medium")
    if args.cpu_calibration:
        calibration = calibrate(args.cpu_calibration)
        machine, fitted = calibration.for_hardware(None)
        cpu = axes[2]
        for name in ("launch-bound", "wide-output"):
            profile = example_profile(name)
            for strategy, style in ((dp, "-"), (persistent, "--")):
                curve = speedup_curve(profile, machine, strategy, 2, BATCHES, "32", fitted, "sgd", per_device=False)
                cpu.plot(
                    [b for b, _ in curve],
                    [s for _, s in curve],
                    linestyle=style,
                    marker="o",
                    markersize=3,
                    label=f"{name}, {strategy}",
                )
        cpu.axhline(1.0, color="grey", linewidth=1)
        cpu.set_xscale("log", base=2)
        cpu.set_xlabel("global batch (samples per step)")
        cpu.set_ylabel("2 virtual CPU devices / one (samples/s, predicted)")
        slots = machine.compute_slots
        cpu.set_title(f"this machine, calibrated ({slots:.1f} of its cores free when measured)", fontsize="medium")
        cpu.legend(fontsize="small")
    figure.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    print(f"wrote {out}")
    print(f"break-even global batch for {dp} on {args.devices}x {gpu.name} ({constants.source}):")
    print(f"  {'model':<44}" + "".join(f"{name:>14}" for name in LINKS))
    for label, _, per_link in rows:
        cells = "".join(f"{(f'{b:,}' if b is not None else 'never'):>14}" for b in per_link)
        print(f"  {label:<44}{cells}")


if __name__ == "__main__":
    main()
