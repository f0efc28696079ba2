"""What per-process streams cost per step against global batches: the rows exchanged before each batch.

Under ddp and fsdp, 2 processes train make bench's MLP (3 x 1536, batch 512 in all, SGD) through the Engine,
in windows of steps that rotate over

    global     a map-style DataLoader through engine.setup_dataloader: each process loads its share of every
               global batch (no exchange: every process knows every share)
    stream     each process's own batches through engine.setup_dataloader (engine/process_streams.py): one
               all-reduce of the ranks' row counts before each batch, the mean loss counted as a sum over its rows,
               and the step divided by the union's rows (known from the exchange: no reduction at the step)

so machine load hits them alike; rank 0 prints the median ms per step of each, its ratio to `global`, and the
median of the per-window ratios (each window's median against `global`'s in the same window).

    .venv/bin/python benchmarks/stream_counts_overhead.py [--strategy ddp|fsdp] [--windows 9] [--steps 4]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

GLOBAL, STREAM = "global", "stream"


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from dpkit.engine.engine import Engine

    engine = Engine(strategy=args.strategy, accelerator="cpu", devices=2, progress=False)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(1536, 1536), nn.ReLU()]
    bare = nn.Sequential(*layers, nn.Linear(1536, 10))
    model, optimizer = engine.setup(bare, torch.optim.SGD(bare.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(512, 1536, generator=generator), torch.randint(0, 10, (512,), generator=generator)
    # the same rows either way: the global batch of 512, or this process's half of it as its own stream
    global_batches = engine.setup_dataloader(DataLoader(TensorDataset(x, y), batch_size=512))
    half = slice(engine.rank * 256, (engine.rank + 1) * 256)
    stream = engine.setup_dataloader(itertools.repeat((x[half], y[half])))
    batches = {GLOBAL: itertools.cycle(global_batches), STREAM: iter(stream)}

    def step(kind: str) -> float:
        began = time.perf_counter()
        bx, by = next(batches[kind])
        optimizer.zero_grad()
        engine.backward(F.cross_entropy(model(bx), by))
        optimizer.step()
        return time.perf_counter() - began

    kinds = [GLOBAL, STREAM]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    paired: dict[str, list[float]] = {kind: [] for kind in kinds}
    for kind in kinds:  # warm up every path
        step(kind)
    for window in range(args.windows):
        order = kinds if window % 2 == 0 else kinds[::-1]
        medians = {}
        for kind in order:
            measured = [step(kind) for _ in range(args.steps)]
            times[kind] += measured
            medians[kind] = statistics.median(measured)
        for kind in kinds:
            paired[kind].append(medians[kind] / medians[GLOBAL])
    if engine.rank == 0:
        base = statistics.median(times[GLOBAL])
        print(f"{args.strategy}, 2 processes, make bench's MLP (3 x 1536, batch 512), {args.windows} windows of "
              f"{args.steps} steps; median ms per step, ratio to global, median of per-window ratios")  # fmt: skip
        for kind in kinds:
            median = statistics.median(times[kind])
            print(f"  {kind:<7} {median * 1e3:8.1f} ms   {median / base:6.3f}   {statistics.median(paired[kind]):6.3f}")
    engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"))
    parser.add_argument("--windows", type=int, default=9)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    from dpkit.launch import launch

    launch(os.path.abspath(__file__), sys.argv[1:], nproc_per_node=2)


if __name__ == "__main__":
    main()
