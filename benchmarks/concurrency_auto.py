"""The replica runner's `concurrency="auto"` (measured once, then frozen) against the online learners it replaced
(apply.Turns: five per run, a 20 ms lock timeout, measured again every 500 runs), on the launch-bound example.

Both versions of dpkit run in this one process, so windows of steps can alternate between them and a change in the
machine's load hits all alike: the old version is a source tree given by --old-src (e.g. `git archive <commit> src |
tar -x -C /tmp/old`), copied to a temporary folder as the package `dpkit_old`. Each contender trains `dp` or
`replicated` through the Engine on 2 virtual CPU devices with one intra-op thread each (as `make bench`), global
batch 32, SGD:

    learners (old)   the old version, as a run gets it by default
    auto             the new version's default: auto at every call site
    threads          the new version, every call site forced side by side (concurrency_decided), for reference
    serial           the new version, every call site forced one after the other on the calling thread
    single           the new version on one device, for reference

A contender first runs --warmup steps (the learners and auto decide there), then --windows windows of --steps steps,
the order rotating every window; its figure is the median window. The whole is repeated --repeats times with fresh
engines (each repeat decides anew), and the figure printed is the median of the repeats. Printed: ms per step side
by side, auto against the learners, and what each decided in each repeat.

    python benchmarks/concurrency_auto.py --old-src /tmp/old/src
    python benchmarks/concurrency_auto.py --old-src /tmp/old/src --repeats 5 --json auto.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import dpkit
from dpkit.examples import get_example
from dpkit.parallel.concurrency import concurrency_decided

STRATEGIES = ("dp", "replicated")
WAYS = ("learners (old)", "auto", "threads", "serial")


def import_old(src: str, folder: str) -> Any:
    """The dpkit under `src` as the package dpkit_old (every `dpkit` name in its code renamed)."""
    target = Path(folder, "dpkit_old")
    shutil.copytree(Path(src, "dpkit"), target, ignore=shutil.ignore_patterns("__pycache__"))
    for path in target.rglob("*.py"):
        path.write_text(re.sub(r"\bdpkit\b(?!-)", "dpkit_old", path.read_text()))
    sys.path.insert(0, folder)
    return importlib.import_module("dpkit_old")


def decisions(engine: Any, model: Any) -> dict[str, str | None]:
    """What each call site decided, in either version."""

    def say(policy: Any) -> str | None:
        if hasattr(policy, "choice"):  # the new Concurrency
            return policy.choice()
        taking = getattr(policy, "taking", None)  # the old Turns
        return None if taking is None else ("serial" if taking else "threads")

    found: dict[str, str | None] = {}
    for module in model.modules():
        sites = getattr(module, "concurrency", None) or getattr(module, "turns", None)
        if isinstance(sites, dict) and hasattr(module, "device_ids"):  # DataParallel
            found.update({f"dp {'train' if site in (True, 'train') else 'eval'}": say(p) for site, p in sites.items()})
    for site, policy in (getattr(engine.strategy, "turns", None) or {}).items():
        found[site] = say(policy)
    gradients = getattr(engine.strategy, "gradients", None)
    if gradients is not None:
        found["backward"] = say(getattr(gradients, "concurrency", None) or getattr(gradients, "turns", None))
    return {site: way for site, way in found.items() if not site.endswith("eval") and site != "forward"}


def contender(package: Any, strategy: str, devices: int, way: str | None, batch_size: int) -> tuple[Callable, Any]:
    """One step of the user's loop through `package`'s Engine; the Engine and model, for the decisions."""
    engine = package.Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False)
    example = get_example("launch-bound")
    torch.manual_seed(0)
    x, y = example.load_data(0)[:2]
    x, y = x[:batch_size], y[:batch_size]
    bare = example.build_model()
    model, optimizer = engine.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.01))
    criterion = engine.setup_criterion(F.cross_entropy)
    forced = (lambda: concurrency_decided(way)) if way in ("threads", "serial") else contextlib.nullcontext

    def step() -> None:
        with forced():
            optimizer.zero_grad()
            engine.backward(criterion(model(x), y))
            optimizer.step()

    return step, (engine, model)


def one_repeat(args: argparse.Namespace, old: Any) -> tuple[dict[str, float], dict[str, dict]]:
    built: dict[str, tuple[Callable, Any]] = {"single": contender(dpkit, "single", 1, None, args.batch_size)}
    for strategy in STRATEGIES:
        for way in WAYS:
            package = old if way == "learners (old)" else dpkit
            built[f"{strategy}, {way}"] = contender(package, strategy, 2, way, args.batch_size)
    for step, _ in built.values():
        for _ in range(args.warmup):
            step()
    names = list(built)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for window in range(args.windows):
        for name in names[window % len(names) :] + names[: window % len(names)]:
            began = time.perf_counter()
            for _ in range(args.steps):
                built[name][0]()
            seconds[name].append((time.perf_counter() - began) / args.steps)
    decided = {name: decisions(*built[name][1]) for name in names if "learners" in name or name.endswith("auto")}
    for _, (engine, _) in built.values():
        engine.close()
    return {name: statistics.median(values) for name, values in seconds.items()}, decided


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-src", required=True, help="the src/ folder of dpkit with the learners")
    parser.add_argument("--repeats", type=int, default=3, help="fresh engines, each deciding anew")
    parser.add_argument("--warmup", type=int, default=40, help="steps before measuring (the learning happens here)")
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10, help="steps per window")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", default=None, help="write the numbers here")
    args = parser.parse_args()
    if not Path(args.old_src, "dpkit").is_dir():
        parser.error(f"--old-src: {args.old_src} holds no dpkit/ folder; give the src/ folder of the old version")
    torch.set_num_threads(1)  # one intra-op thread per device, as `make bench`; replica threads take their share
    with tempfile.TemporaryDirectory(prefix="dpkit-old-") as folder:
        old = import_old(args.old_src, folder)
        load_before = os.getloadavg()
        repeats = [one_repeat(args, old) for _ in range(args.repeats)]
        load_after = os.getloadavg()
    names = list(repeats[0][0])
    medians = {name: statistics.median(r[0][name] for r in repeats) for name in names}
    print(
        f"launch-bound example, global batch {args.batch_size}, SGD, 2 virtual CPU devices, 1 intra-op thread each; "
        f"median of {args.repeats} repeats, each the median of {args.windows} windows of {args.steps} steps after "
        f"{args.warmup} warm-up steps, contenders interleaved in one process"
    )
    print(
        f"load average (1, 5, 15 min) before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
        f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; {os.cpu_count()} CPUs"
    )
    # each repeat's figures over its own single-device step: what the load of that repeat did to all, divided out
    to_single = {name: statistics.median(r[0][name] / r[0]["single"] for r in repeats) for name in names}
    for name in names:
        each = ", ".join(f"{r[0][name] * 1e3:.2f}" for r in repeats)
        print(f"  {name:28s} {medians[name] * 1e3:8.3f} ms/step  {to_single[name]:5.2f}x single   (repeats: {each})")
    for strategy in STRATEGIES:
        ratio = medians[f"{strategy}, auto"] / medians[f"{strategy}, learners (old)"]
        best = min(medians[f"{strategy}, threads"], medians[f"{strategy}, serial"])
        against_best = medians[f"{strategy}, auto"] / best
        print(f"  {strategy}: auto / learners {ratio:.3f}; auto / the faster forced way {against_best:.3f}")
        normalized = to_single[f"{strategy}, auto"] / to_single[f"{strategy}, learners (old)"]
        print(f"  {strategy}: auto / learners, each repeat over its single step: {normalized:.3f}")
        for name in (f"{strategy}, learners (old)", f"{strategy}, auto"):
            print(f"    {name} decided: " + "; ".join(json.dumps(r[1][name], sort_keys=True) for r in repeats))
    if args.json:
        report = {
            "ms_per_step": {name: medians[name] * 1e3 for name in names},
            "ms_per_step_each_repeat": {name: [r[0][name] * 1e3 for r in repeats] for name in names},
            "over_single": to_single,
            "decided": {name: [r[1][name] for r in repeats] for name in repeats[0][1]},
            "load_average": [load_before, load_after],
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
