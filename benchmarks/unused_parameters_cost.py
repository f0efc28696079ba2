"""What find_unused_parameters=True costs a ddp step on the compute-bound example (wide-blocks), 2 processes, gloo.

With the option, torch's DDP walks the autograd graph from the outputs after every forward to find the
parameters the step leaves out; without it (dpkit's default), a hook on each trainable parameter notes those
that got a gradient and backward stops with one line if one did not (strategies/ddp.py). The same two processes
train wide-blocks (4 blocks of 960-wide layers, 7.4M parameters, 128 rows per process, SGD) through three
Engines, each its own DDP, in windows of steps that rotate over

    default          find_unused_parameters=False, dpkit's check on
    find_unused      find_unused_parameters=True
    default, again   the noise floor

so machine load hits them alike; rank 0 prints the median ms per step of each, its ratio to `default`, and the
median of the per-window ratios (each window's median against the mean of the two defaults' medians in the same
window: drift cancels, and the two defaults' own ratios show the noise left).

    .venv/bin/python benchmarks/unused_parameters_cost.py [--windows 9] [--steps 4] [--rows 128]

Measured (2 shared cores, --windows 21 --steps 3, two runs): find_unused 101.0 -> 111.3 ms (1.103, per-window
1.108) and 147.5 -> 161.0 ms (1.092, per-window 1.113), the defaults within 0.5% of each other: about 10% of a
step, so find_unused_parameters stays off by default (docs/strategies.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

DEFAULT, FIND_UNUSED, DEFAULT_AGAIN = "default", "find_unused", "default, again"


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from dpkit.engine.engine import Engine
    from dpkit.examples.wide_blocks import CLASSES, FEATURES, WideBlocksNet

    steps = {}
    for name in (DEFAULT, FIND_UNUSED, DEFAULT_AGAIN):
        engine = Engine(
            strategy="ddp",
            accelerator="cpu",
            devices=2,
            progress=False,
            find_unused_parameters=name == FIND_UNUSED,
        )
        torch.manual_seed(0)
        model = WideBlocksNet()
        model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
        steps[name] = (engine, model, optimizer)
    generator = torch.Generator().manual_seed(engine.rank)
    x = torch.randn(args.rows, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (args.rows,), generator=generator)

    def step(name: str) -> float:
        engine, model, optimizer = steps[name]
        began = time.perf_counter()
        optimizer.zero_grad()
        engine.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        return time.perf_counter() - began

    variants = list(steps)
    times: dict[str, list[float]] = {name: [] for name in variants}
    paired: dict[str, list[float]] = {name: [] for name in variants}  # per window: median / the defaults' mean
    for name in variants:  # warm up every path
        step(name)
        step(name)
    for window in range(args.windows):
        order = variants[window % len(variants) :] + variants[: window % len(variants)]
        window_medians = {}
        for name in order:
            measured = [step(name) for _ in range(args.steps)]
            times[name] += measured
            window_medians[name] = statistics.median(measured)
        baseline = (window_medians[DEFAULT] + window_medians[DEFAULT_AGAIN]) / 2
        for name in variants:
            paired[name].append(window_medians[name] / baseline)
    if engine.rank == 0:
        base = statistics.median(times[DEFAULT])
        print(f"ddp, 2 processes (gloo), wide-blocks (7.4M parameters, {args.rows} rows per process), "
              f"{args.windows} windows of {args.steps} steps; median ms per step, ratio to default, "
              "median of per-window ratios to the defaults' mean")  # fmt: skip
        for name in variants:
            median = statistics.median(times[name])
            print(
                f"  {name:<15} {median * 1e3:8.1f} ms   {median / base:6.3f}   {statistics.median(paired[name]):6.3f}"
            )
    for engine, _, _ in steps.values():
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=9)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=128, help="rows per process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from dpkit.launch import launch

    forwarded = ["--worker", "--windows", str(args.windows), "--steps", str(args.steps), "--rows", str(args.rows)]
    launch(os.path.abspath(__file__), forwarded, nproc_per_node=2)


if __name__ == "__main__":
    sys.exit(main())
