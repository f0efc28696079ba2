"""DataParallel's per-step work on a launch-bound step, before and after issue 21, side by side in one process.

On 2 virtual CPU devices with one intra-op thread each, the `launch-bound` example (40 small residual layers,
global batch 32, SGD) is trained through the Engine by

    single                 the reference: one device
    dp                     kept replicas (DataParallel's replica cache), one broadcast node per step, and the
                           replicas' forwards in turns when that is faster (learned)
    dp, before             every replica built anew at every step (DataParallel(cache_replicas=False)) and
                           the forwards always side by side
    replicated             the gradient sum in a few foreach calls per thread, no per-parameter hooks, forwards
                           in turns when faster
    replicated, before     one call per parameter slice, a hook on every parameter (coalesce_reduce=False), and
                           the forwards always side by side

Windows of steps alternate over the contenders in a rotating order, so changing machine load hits them
alike, and medians are compared. Printed: each contender's ms per step and its ratio to `single`, the issue's
targets (dp <= 2.35x single, replicated <= 2.5x), what each change bought (before / after), and then, for
every strategy, where its step goes by thread (dpkit.observe's step split, measured with a lean observer:
no memory accounts, no per-device marking of the backward).

    python benchmarks/launch_bound.py                                   # the launch-bound example
    python benchmarks/launch_bound.py --example launch-bound-conv
    python benchmarks/launch_bound.py --before                          # only single and the before paths
    python benchmarks/launch_bound.py --compute-bound --windows 9       # make bench's MLP: nothing lost there
    python benchmarks/launch_bound.py --dpkit-src /tmp/old/src --rounds 5  # this dpkit against another checkout's

With --dpkit-src, single, dp and replicated (as --after) run in fresh processes, --rounds times, alternating between
this dpkit and the one under PATH (its `src`, put first on PYTHONPATH), and the medians of each process's ratios
to single are compared: two commits paired in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import dpkit
from dpkit.engine.engine import Engine
from dpkit.examples import EXAMPLES, get_example
from dpkit.observe import Observer
from dpkit.observe.report import thread_lines

DEVICES = 2
SINGLE, DP, DP_BEFORE, REPLICATED, REPLICATED_BEFORE = (
    "single",
    "dp",
    "dp, before",
    "replicated",
    "replicated, before",
)
TARGETS = {DP: 2.35, REPLICATED: 2.5}  # at most this many times single's step


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model and one global batch."""
    torch.manual_seed(0)
    if args.compute_bound:  # make bench's MLP (benchmarks/strategies_throughput.py)
        layers: list[nn.Module] = []
        for _ in range(3):
            layers += [nn.Linear(1536, 1536), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(1536, 10))
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch_size, 1536, generator=generator)
        return model, x, torch.randint(0, 10, (args.batch_size,), generator=generator)
    example = get_example(args.example)
    x, y = example.load_data(0)[:2]
    return example.build_model(), x[: args.batch_size], y[: args.batch_size]


def contender(args: argparse.Namespace, name: str) -> tuple[Callable[[], None], Engine]:
    """One step of the user's loop through the Engine, as a closure; the Engine too (for the step split)."""
    strategy = name.split(",")[0]
    options = {"coalesce_reduce": False} if name == REPLICATED_BEFORE else {}
    devices = 1 if strategy == SINGLE else DEVICES
    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False, **options)
    model, x, y = build(args)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    if name == DP_BEFORE:  # the replicas built anew at every step, as torch's DataParallel builds them
        for module in model.modules():
            if isinstance(module, dpkit.DataParallel):
                module.replica_cache = None  # what DataParallel(..., cache_replicas=False) sets
                module.set_concurrency("threads")
    if name == REPLICATED_BEFORE:
        engine.strategy.set_concurrency("threads")
    criterion = engine.setup_criterion(F.cross_entropy)

    def step() -> None:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        engine.backward(loss)
        optimizer.step()

    return step, engine


def measure(steps: dict[str, Callable[[], None]], windows: int, per_window: int, warmup: int) -> dict[str, float]:
    """Median seconds per step of each contender over `windows` windows, the order rotating every window."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    names = list(steps)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for window in range(windows):
        for name in names[window % len(names) :] + names[: window % len(names)]:
            began = time.perf_counter()
            for _ in range(per_window):
                steps[name]()
            seconds[name].append((time.perf_counter() - began) / per_window)
    return {name: statistics.median(values) for name, values in seconds.items()}


def step_split(step: Callable[[], None], engine: Engine, count: int) -> dict:
    """Where `count` steps go by thread, measured with a lean observer (memory off, no per-device marking)."""
    with Observer(engine.device, memory=False, trace=False, backward_by_device=False) as observer:
        for _ in range(count):
            step()
    return observer.report().threads


def paired(args: argparse.Namespace) -> None:
    """--dpkit-src: this dpkit and the one under args.dpkit_src in fresh processes taking turns, --rounds each; the
    medians of their ratios to single side by side."""
    sources = {"this dpkit": str(Path(dpkit.__file__).resolve().parent.parent), "--dpkit-src": args.dpkit_src}
    argv = ["--after", "--example", args.example, "--windows", str(args.windows), "--warmup", str(args.warmup)]
    argv += ["--split-steps", "0"] + (["--compute-bound"] if args.compute_bound else [])
    argv += ["--batch-size", str(args.batch_size)] + (["--steps", str(args.steps)] if args.steps else [])
    ratios: dict[str, dict[str, list[float]]] = {side: {DP: [], REPLICATED: []} for side in sources}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            order = list(sources) if round_ % 2 == 0 else list(sources)[::-1]
            for side in order:
                result = Path(folder, f"{round_}-{len(ratios[side][DP])}-{side[:4]}.json")
                environment = dict(
                    os.environ, PYTHONPATH=os.pathsep.join(filter(None, [sources[side], os.environ.get("PYTHONPATH")]))
                )
                subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), *argv, "--json", str(result)],
                    env=environment,
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                to_single = json.loads(result.read_text())["ratio_to_single"]
                for name in (DP, REPLICATED):
                    ratios[side][name].append(to_single[name])
            line = ", ".join(
                f"{side}: dp {ratios[side][DP][-1]:.2f}x, replicated {ratios[side][REPLICATED][-1]:.2f}x"
                for side in sources
            )
            print(f"round {round_ + 1}: {line}", flush=True)
    load_after = os.getloadavg()
    print(
        f"load average (1, 5, 15 min) before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
        f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; {os.cpu_count()} CPUs"
    )
    print(f"medians of {args.rounds} fresh processes each (ms per step / single's, lower is better):")
    for side, src in sources.items():
        cells = []
        for name in (DP, REPLICATED):
            ratio = statistics.median(ratios[side][name])
            verdict = (
                ""
                if args.compute_bound
                else f" (target <= {TARGETS[name]}x: {'met' if ratio <= TARGETS[name] else 'NOT met'})"
            )
            cells.append(f"{name} {ratio:.3f}x{verdict}")
        print(f"  {side:12s} {', '.join(cells)}   [{src}]")
    for name in (DP, REPLICATED):
        mine, other = (statistics.median(ratios[side][name]) for side in sources)
        print(f"  {name}: this dpkit / --dpkit-src {mine / other:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default="launch-bound", choices=sorted(EXAMPLES))
    parser.add_argument("--compute-bound", action="store_true", help="make bench's MLP (1536 wide, batch 512)")
    parser.add_argument("--batch-size", type=int, default=None, help="global batch (32; 512 with --compute-bound)")
    parser.add_argument("--before", action="store_true", help="run single and the before paths only")
    parser.add_argument("--after", action="store_true", help="run single and the new paths only")
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--steps", type=int, default=None, help="steps per window (10; 2 with --compute-bound)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--split-steps", type=int, default=None, help="steps observed for each step split (0: none)")
    parser.add_argument("--json", default=None, help="write the numbers here")
    parser.add_argument("--dpkit-src", default=None, metavar="PATH", help="pair with the dpkit under PATH (see above)")
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per side with --dpkit-src (default 5)")
    args = parser.parse_args()
    args.batch_size = args.batch_size or (512 if args.compute_bound else 32)
    if args.dpkit_src:
        paired(args)
        return
    per_window = args.steps or (2 if args.compute_bound else 10)
    split_steps = (5 if args.compute_bound else 100) if args.split_steps is None else args.split_steps
    torch.set_num_threads(1)  # one intra-op thread per device, as `make bench`; replica threads take their share

    names = [SINGLE, DP, DP_BEFORE, REPLICATED, REPLICATED_BEFORE]
    if args.before:
        names = [SINGLE, DP_BEFORE, REPLICATED_BEFORE]
    elif args.after:
        names = [SINGLE, DP, REPLICATED]
    built = {name: contender(args, name) for name in names}
    load_before = os.getloadavg()
    medians = measure({name: step for name, (step, _) in built.items()}, args.windows, per_window, args.warmup)
    load_after = os.getloadavg()

    model = "make bench's MLP (3 x 1536, 10 classes)" if args.compute_bound else f"example {args.example!r}"
    print(
        f"{model}, global batch {args.batch_size}, SGD, {DEVICES} virtual CPU devices with 1 intra-op thread each; "
        f"median of {args.windows} windows of {per_window} steps, interleaved in one process"
    )
    print(
        f"load average (1, 5, 15 min) before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
        f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; {os.cpu_count()} CPUs"
    )
    single = medians[SINGLE]
    for name in names:
        ratio = medians[name] / single
        target = TARGETS.get(name)
        verdict = (
            ""
            if target is None or args.compute_bound
            else f"   target <= {target}x: {'met' if ratio <= target else 'NOT met'}"
        )
        print(f"  {name:20s} {medians[name] * 1e3:9.3f} ms/step   {ratio:5.2f}x single{verdict}")
    for new, old in ((DP, DP_BEFORE), (REPLICATED, REPLICATED_BEFORE)):
        if new in medians and old in medians:
            extra_new, extra_old = medians[new] - single, medians[old] - single
            print(
                f"  {new}: after / before {medians[new] / medians[old]:.3f}; its extra time over single "
                f"{extra_new * 1e3:.3f} ms against {extra_old * 1e3:.3f} ms ({extra_new / extra_old:.2f} of it)"
            )

    splits = {}
    if split_steps:
        print(f"\nwhere a step goes by thread ({split_steps} steps each, lean observer):")
    for name, (step, engine) in built.items() if split_steps else ():
        splits[name] = step_split(step, engine, split_steps)
        print(f"{name}:")
        for line in thread_lines(splits[name]):
            print("  " + line.strip())

    if args.json:
        report = {
            "model": model,
            "batch_size": args.batch_size,
            "devices": DEVICES,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "seconds_per_step": medians,
            "ratio_to_single": {name: seconds / single for name, seconds in medians.items()},
            "threads": splits,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    for _, engine in built.values():
        engine.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
