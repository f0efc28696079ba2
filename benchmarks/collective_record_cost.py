"""What the collective record and the step check cost on the compute-bound example, ddp and fsdp, 2 processes.

The record (observe/collectives.py: every collective numbered with its op, size, step and the user's line) and
the step marks (every rank's place carried in a step's first collective, checked on return) are on by default.
Here the same two processes train make bench's MLP (3 x 1536, batch 512, SGD) through the Engine in windows of
steps that rotate over

    off            no record, no marks (torch's collectives unwrapped, ddp's plain all-reduce hook)
    record         the record only
    record+marks   the record and the step marks: the default
    off, again     the noise floor

so machine load hits them alike; rank 0 prints the median ms per step of each, its ratio to `off`, and the
median of the per-window ratios (each window's median against `off`'s in the same window: drift cancels).
Under `--hang-timeout` (the default here) the default also wakes the heartbeat's thread once a step, which
tells the launcher the step's first collective.

    .venv/bin/python benchmarks/collective_record_cost.py [--strategy ddp|fsdp] [--windows 9] [--steps 4]
    .venv/bin/python benchmarks/collective_record_cost.py --parts     # each part alone, in this process
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

OFF, RECORD_ONLY, DEFAULT, OFF_AGAIN = "off", "record", "record+marks", "off, again"


def set_variant(strategy, variant: str) -> None:
    from dpkit.observe.collectives import RECORD, record_torch_collectives, stop_recording_torch_collectives

    recording = variant in (RECORD_ONLY, DEFAULT)
    RECORD.enabled = recording
    (record_torch_collectives if recording else stop_recording_torch_collectives)()
    strategy.marking_steps = variant == DEFAULT


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from dpkit.engine.engine import Engine

    engine = Engine(strategy=args.strategy, accelerator="cpu", devices=2)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(1536, 1536), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(1536, 10))
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(engine.rank)
    x = torch.randn(512 // 2, 1536, generator=generator)
    y = torch.randint(0, 10, (512 // 2,), generator=generator)

    def step() -> float:
        began = time.perf_counter()
        optimizer.zero_grad()
        engine.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        return time.perf_counter() - began

    variants = [OFF, RECORD_ONLY, DEFAULT, OFF_AGAIN]
    times: dict[str, list[float]] = {name: [] for name in variants}
    paired: dict[str, list[float]] = {name: [] for name in variants}  # per window: median / off's median
    for name in variants:  # warm up every path
        set_variant(engine.strategy, name)
        step()
    for window in range(args.windows):
        order = variants[window % len(variants) :] + variants[: window % len(variants)]
        window_medians = {}
        for name in order:
            set_variant(engine.strategy, name)
            measured = [step() for _ in range(args.steps)]
            times[name] += measured
            window_medians[name] = statistics.median(measured)
        for name in variants:
            paired[name].append(window_medians[name] / window_medians[OFF])
    set_variant(engine.strategy, DEFAULT)
    if engine.rank == 0:
        base = statistics.median(times[OFF])
        print(f"{args.strategy}, 2 processes, make bench's MLP (3 x 1536, batch 512), {args.windows} windows "
              f"of {args.steps} steps; median ms per step, ratio to off, median of per-window ratios")  # fmt: skip
        for name in variants:
            median = statistics.median(times[name])
            print(
                f"  {name:<13} {median * 1e3:8.1f} ms   {median / base:6.3f}   {statistics.median(paired[name]):6.3f}"
            )
    engine.close()


def parts() -> None:
    """Each part of the cost alone, one thread, medians: a record entry 30 frames deep, the ddp marks on DDP's
    1 MiB first bucket, the fsdp marks on a small (root unit) and a 9 MiB all-gather of 2 ranks."""
    import torch

    from dpkit.observe.collectives import GRADIENTS, CollectiveRecord, read_marks, step_marks

    torch.set_num_threads(1)
    record = CollectiveRecord()

    def entries(depth: int) -> float:
        if depth:
            return entries(depth - 1)
        began = time.perf_counter()
        for _ in range(10_000):
            with record.issuing("all_reduce", 16):
                pass
        return (time.perf_counter() - began) / 10_000

    def timed(work, repeats: int = 100) -> float:
        for _ in range(10):
            work()
        samples = []
        for _ in range(repeats):
            began = time.perf_counter()
            work()
            samples.append(time.perf_counter() - began)
        return statistics.median(samples)

    bucket = torch.randn(1 << 18)

    def ddp_marks() -> None:
        marks = step_marks(record, GRADIENTS, 0, 2, bucket.dtype, bucket.device)
        combined = torch.cat([bucket / 2, marks])
        bucket.copy_(combined[: bucket.numel()])
        read_marks(combined[bucket.numel() :], 2)

    def fsdp_marks(shard: torch.Tensor, output: torch.Tensor):
        def work() -> None:  # what the marks add around the gather (the gather itself left out)
            combined = torch.cat([shard, step_marks(record, GRADIENTS, 0, 2, shard.dtype, shard.device)])
            rows = torch.empty(2 * combined.numel()).view(2, -1)
            output.view(2, -1).copy_(rows[:, : shard.numel()])
            read_marks(rows[:, shard.numel() :].sum(0), 2)

        return work

    print(f"record entry, 30 frames deep:        {statistics.median(entries(30) for _ in range(5)) * 1e6:8.1f} us")
    print(f"ddp marks on a 1 MiB first bucket:   {timed(ddp_marks) * 1e6:8.1f} us")
    for numel in (15_370, 1536 * 1536 + 1536):
        shard, output = torch.randn(numel // 2), torch.empty(numel // 2 * 2)
        label = f"fsdp marks on a {numel * 4 / 2**20:.2f} MiB gather:"
        print(f"{label:<37}{timed(fsdp_marks(shard, output)) * 1e6:8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--windows", type=int, default=9)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hang-timeout", type=float, default=60.0)
    parser.add_argument("--parts", action="store_true", help="time each part alone, in this process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.parts:
        parts()
        return
    if args.worker:
        worker(args)
        return
    from dpkit.launch import launch

    forwarded = ["--worker", "--strategy", args.strategy, "--windows", str(args.windows), "--steps", str(args.steps)]
    launch(os.path.abspath(__file__), forwarded, nproc_per_node=2, hang_timeout_seconds=args.hang_timeout)


if __name__ == "__main__":
    sys.exit(main())
