"""Step time of dpkit's Lightning strategy in each mode against Lightning's own `ddp`, side by side.

One small LightningModule (an MLP), one global batch, SGD; every contender is a Lightning Trainer run of the
same number of optimizer steps:

    single                  Trainer(accelerator="cpu", devices=1)                          (for reference)
    dp, dp-balanced,        Trainer(strategy=dpkit.lightning.DataParallelStrategy(mode,
    replicated                      devices=["cpu:0", "cpu:1"]))                           one process
    ddp                     Trainer(strategy="ddp", accelerator="cpu", devices=2)          2 processes, gloo

Every device is one core: dpkit gives each device thread one intra-op thread (its default on 2 cores),
Lightning gives each of its 2 ddp processes one (its own setting: cores / processes), and this process's
own intra-op threads are set to --threads (default 1), which is what `single` and the work dp and
dp-balanced do on the calling thread (their backward) run on. On a busy machine more intra-op threads than
free cores make torch's thread pool wait for descheduled peers, so 1 is also the robust setting.

Lightning's ddp starts its own processes (it runs this script again for rank 1), so it runs in a subprocess
of this script; each of its processes loads half of every global batch (DistributedSampler), so every
contender steps on the same global batch. A step's time is the time between two consecutive
on_train_batch_end calls (rank 0 under ddp); the first --warmup steps of every run are dropped. The
contenders run in rounds (A B C D E, A B C D E, ...), so a change of machine load hits them alike, and the
medians over all rounds are compared: "speed vs ddp" is ddp's median step time over the contender's
(above 1: faster than ddp).

    python benchmarks/lightning_modes.py
    python benchmarks/lightning_modes.py --rounds 5 --steps 40 --width 512 --batch-size 256 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

DEVICES = 2
FEATURES, CLASSES = 256, 10


class MLP(L.LightningModule):
    def __init__(self, width: int, depth: int):
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(FEATURES, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, CLASSES))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepTimes(L.Callback):
    def __init__(self):
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())

    def durations_ms(self, warmup: int) -> list[float]:
        return [(b - a) * 1000 for a, b in zip(self.ends[warmup:], self.ends[warmup + 1 :])]


def dataset(rows: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(rows, FEATURES, generator=generator), torch.randint(0, CLASSES, (rows,), generator=generator)
    )


def fit(strategy, args, batch_size: int, **trainer_options) -> StepTimes:
    """A run of args.warmup + args.steps + 1 optimizer steps; its step times."""
    steps = args.warmup + args.steps + 1
    torch.manual_seed(0)
    timer = StepTimes()
    trainer = L.Trainer(
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        **trainer_options,
    )
    loader = DataLoader(dataset(args.batch_size * steps), batch_size=batch_size)
    trainer.fit(MLP(args.width, args.depth), loader)
    return timer


def one_process(name: str, args) -> list[float]:
    from dpkit.lightning import DataParallelStrategy

    if name == "single":
        timer = fit("auto", args, args.batch_size, accelerator="cpu", devices=1)
    else:
        devices = [f"cpu:{i}" for i in range(DEVICES)]
        timer = fit(DataParallelStrategy(name, devices=devices), args, args.batch_size)
    return timer.durations_ms(args.warmup)


def ddp_worker(args) -> None:
    """Run by the subprocess (and by Lightning again for rank 1): Lightning's ddp on 2 CPU processes."""
    timer = fit("ddp", args, args.batch_size // DEVICES, accelerator="cpu", devices=DEVICES)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        Path(args.ddp_out).write_text(json.dumps(timer.durations_ms(args.warmup)))


def ddp(args) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="lightning-ddp-") as scratch:
        out = Path(scratch) / "times.json"
        command = [sys.executable, __file__, *sys.argv[1:], "--ddp-out", str(out)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"Lightning's ddp run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every contender, in turn")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped at the start of each run")
    parser.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=2, help="hidden layers of the MLP")
    parser.add_argument("--batch-size", type=int, default=256, help="the global batch (ddp: half per process)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of this process's own thread")
    parser.add_argument("--ddp-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.ddp_out is not None:
        ddp_worker(args)
        return
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    contenders = ["single", "dp", "dp-balanced", "replicated", "ddp"]
    times: dict[str, list[float]] = {name: [] for name in contenders}
    load_before = os.getloadavg()
    for round_ in range(args.rounds):
        order = contenders[round_ % len(contenders) :] + contenders[: round_ % len(contenders)]
        for name in order:
            times[name] += ddp(args) if name == "ddp" else one_process(name, args)
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    load_after = os.getloadavg()
    reference = statistics.median(times["ddp"])
    parameters = sum(p.numel() for p in MLP(args.width, args.depth).parameters())
    print(
        f"MLP {FEATURES}-{'-'.join([str(args.width)] * args.depth)}-{CLASSES} ({parameters:,} parameters), "
        f"global batch {args.batch_size}, SGD; {args.rounds} rounds x {args.steps} steps after {args.warmup} "
        f"warm-up steps; {args.threads} intra-op thread(s) on the calling thread; torch {torch.__version__}, "
        f"lightning {L.__version__}, {os.cpu_count()} cores "
        f"({platform.machine()}), load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
    )
    print(f"{'contender':<24}{'median ms/step':>16}{'p10-p90 ms':>16}{'speed vs ddp':>14}")
    labels = {"single": "single (1 device)", "ddp": "Lightning ddp (2 proc)"}
    for name in contenders:
        values = sorted(times[name])
        median = statistics.median(values)
        p10, p90 = values[len(values) // 10], values[(len(values) * 9) // 10]
        label = labels.get(name, f"dpkit {name} (2 dev)")
        print(f"{label:<24}{median:>16.2f}{f'{p10:.1f}-{p90:.1f}':>16}{reference / median:>13.2f}x")


if __name__ == "__main__":
    main()
