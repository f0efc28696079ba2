"""Cost of dpkit.observe: off (DataParallel with nothing observing) vs on (an Observer started), and
off vs the bare verbs (scatter -> replicate -> parallel_apply -> gather, the pre-observe forward).

Each variant runs one training step (forward, loss, backward) in turn, interleaved in a rotating
order, so drift on a shared machine hits them alike; medians and ratios are printed side by side.
"observe on" includes starting and stopping an Observer around the step.

    .venv/bin/python benchmarks/observe_overhead.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import dpkit
from dpkit.examples.digits import DigitsMLP
from dpkit.examples.wide_output import WideOutputNet
from dpkit.observe import Observer
from dpkit.parallel.apply import parallel_apply
from dpkit.parallel.gather import gather
from dpkit.parallel.replicate import replicate
from dpkit.parallel.scatter import batch_size_of, plan_split, scatter


def bare_forward(dp: dpkit.DataParallel, x: torch.Tensor) -> torch.Tensor:
    """The forward as it was before observe existed: checks and four verbs, no hooks."""
    dp.check_placement()
    plan = plan_split(batch_size_of((x,), {}, 0), len(dp.device_ids))
    chunks = scatter((x,), {}, plan, dp.device_ids, 0)
    devices = [device for device, _, _ in chunks]
    replicas = replicate(dp.module, devices, dp.primary_device)
    outputs = parallel_apply(replicas, [a for _, a, _ in chunks], [k for _, _, k in chunks], devices)
    return gather(outputs, dp.output_device, 0)


def measure(name: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, devices: int, repeats: int) -> None:
    dp = dpkit.DataParallel(model, dpkit.cpu_devices(devices))

    def step(forward) -> float:
        model.zero_grad(set_to_none=True)
        began = time.perf_counter()
        F.cross_entropy(forward(x), y).backward()
        return time.perf_counter() - began

    def observed() -> float:
        with Observer():
            return step(dp)

    variants = {
        "bare verbs": lambda: step(lambda t: bare_forward(dp, t)),
        "observe off": lambda: step(dp),
        "observe on": observed,
        "off, again": lambda: step(dp),
    }  # the last one: the noise floor
    for run in variants.values():  # warm the worker threads and allocator
        run()
    times: dict[str, list[float]] = {k: [] for k in variants}
    keys = list(variants)
    for repeat in range(repeats):
        for j in range(len(keys)):  # rotate the order so no variant always follows the same one
            key = keys[(repeat + j) % len(keys)]
            times[key].append(variants[key]())
    medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{name}: {devices} virtual CPU devices, batch {len(x)}, median of {repeats} steps (forward+loss+backward)")
    for key, ms in medians.items():
        print(f"  {key:12s} {ms:9.3f} ms")
    print(
        f"  off / bare = {medians['observe off'] / medians['bare verbs']:.3f}"
        f"    on / off = {medians['observe on'] / medians['observe off']:.3f}"
        f"    noise (off again / off) = {medians['off, again'] / medians['observe off']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    measure(
        "digits MLP (many small ops)",
        DigitsMLP(),
        torch.randn(64, 64, generator=generator),
        torch.randint(0, 10, (64,), generator=generator),
        2,
        args.repeats,
    )
    measure(
        "wide-output (few large ops)",
        WideOutputNet(),
        torch.randn(256, 64, generator=generator),
        torch.randint(0, 20_000, (256,), generator=generator),
        4,
        args.repeats,
    )


if __name__ == "__main__":
    main()
