"""`dpkit train`: train an example (or your model factory) with any strategy; write model.pt and metrics.json.

The same --seed gives the same initial weights and the same global batches whatever the strategy, so
model.pt from every strategy is the same model up to float rounding. With --strategy ddp and no launcher
around it, the command starts its own processes through `dpkit launch` and waits for them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from dpkit.devices import resolve_devices
from dpkit.engine import Engine
from dpkit.examples import EXAMPLES, get_example, load_factory
from dpkit.launch import launch
from dpkit.precision import PRECISIONS
from dpkit.strategies import available_strategies
from dpkit.launch import launched


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help="train an example or your model with any strategy; write model.pt and metrics.json")
    parser.add_argument("--example", default="digits", help=f"data (and model) to train: {', '.join(sorted(EXAMPLES))} (default digits)")
    parser.add_argument("--model", default=None, help="your model instead of the example's, as 'package.module:factory'")
    parser.add_argument("--strategy", default="single", choices=available_strategies())
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--devices", default="auto", help="device count or list (default: 1 for single; all GPUs, else 2 virtual CPU devices)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size, split across devices (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    parser.add_argument("--precision", default="32", choices=list(PRECISIONS))
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--out", default="runs/train", help="folder for model.pt and metrics.json (default runs/train)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def _child_argv(args: argparse.Namespace, n_devices: int) -> list[str]:
    argv = ["train", "--example", args.example, "--strategy", args.strategy, "--accelerator", args.accelerator,
            "--devices", str(n_devices), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--seed", str(args.seed), "--lr", repr(args.lr), "--momentum", repr(args.momentum),
            "--precision", args.precision, "--accumulate", str(args.accumulate), "--out", str(args.out)]
    if args.model:
        argv += ["--model", args.model]
    if args.no_progress:
        argv.append("--no-progress")
    return argv


def run(args: argparse.Namespace) -> int:
    for name in ("steps", "batch_size", "accumulate"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected at least 1, got {getattr(args, name)}")
    get_example(args.example)
    if args.strategy == "ddp" and not launched():
        n_devices = len(resolve_devices(args.accelerator, args.devices))
        launch("dpkit.cli.main", _child_argv(args, n_devices), nproc_per_node=n_devices, module=True)
        metrics = json.loads((Path(args.out) / "metrics.json").read_text())
        print(f"dpkit train: ddp over {n_devices} processes done; final loss {metrics['loss'][-1]:.4f}, "
              f"{metrics['samples_per_second']:.0f} samples/s, test accuracy {metrics['test_accuracy']:.4f}")
        return 0
    return train(args)


def train(args: argparse.Namespace) -> int:
    example = get_example(args.example)
    build_model = load_factory(args.model) if args.model else example.build_model
    engine = Engine(strategy=args.strategy, accelerator=args.accelerator, devices=args.devices, precision=args.precision,
                    accumulate=args.accumulate, progress=not args.no_progress)

    torch.manual_seed(args.seed)  # same initial weights in every process and for every strategy
    model = build_model()
    x_train, y_train, x_test, y_test = example.load_data(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    model, optimizer = engine.setup(model, optimizer)
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    train_data = TensorDataset(x_train, y_train)
    # the batch order comes from its own seeded generator: the same global batches for every strategy
    order = RandomSampler(train_data, generator=torch.Generator().manual_seed(args.seed))
    loader = engine.setup_dataloader(DataLoader(train_data, batch_size=args.batch_size, sampler=order))

    engine.print(f"dpkit train: {args.example} with strategy {args.strategy} on {engine.world_size} process(es), "
                 f"devices {', '.join(map(str, engine.devices))}, global batch {args.batch_size}, precision {args.precision}")
    step_losses, step_rows, step_seconds = [], [], []
    micro_losses, micro_rows = [], 0
    bar = engine.progress(total=args.steps, desc="training", unit="step")
    started = time.perf_counter()
    step_started = started
    while len(step_losses) < args.steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            engine.backward(loss)
            optimizer.step()
            micro_losses.append(loss.detach().float() * len(y))
            micro_rows += len(y)
            if len(micro_losses) == args.accumulate:  # one optimizer step done
                step_losses.append(torch.stack(micro_losses).sum().cpu())
                step_rows.append(micro_rows)
                micro_losses, micro_rows = [], 0
                now = time.perf_counter()
                step_seconds.append(now - step_started)
                step_started = now
                bar.update()
                if len(step_losses) == args.steps:
                    break
    seconds = time.perf_counter() - started
    bar.close()

    # per-process sums -> global sample-weighted mean loss per step (one collective for all steps)
    loss_sums = engine.reduce(torch.stack(step_losses).double(), "sum")
    rows = engine.reduce(torch.tensor(step_rows, dtype=torch.float64), "sum")
    losses = (loss_sums / rows).tolist()
    samples_per_second = float(rows.sum()) / seconds

    model.eval()
    test_loader = engine.setup_dataloader(DataLoader(TensorDataset(x_test, y_test), batch_size=256))
    correct = []
    with torch.no_grad():
        for x, y in test_loader:
            correct.append(engine.gather(model(x).argmax(dim=1) == y))
    correct = torch.cat(correct)

    out = Path(args.out)
    engine.save(model, out / "model.pt")
    if engine.is_global_zero:
        metrics = {
            "strategy": args.strategy, "devices": [str(d) for d in engine.devices], "world_size": engine.world_size,
            "precision": args.precision, "accumulate": args.accumulate, "steps": args.steps,
            "batch_size": args.batch_size, "seed": args.seed, "lr": args.lr, "loss": losses,
            "samples_per_second": samples_per_second, "seconds": seconds,
            "median_step_seconds": sorted(step_seconds)[len(step_seconds) // 2],
            "test_accuracy": float(correct.float().mean()), "test_samples": int(correct.numel()),
        }
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        print(f"final loss {losses[-1]:.4f}, {samples_per_second:.0f} samples/s, test accuracy "
              f"{metrics['test_accuracy']:.4f}; wrote {out / 'model.pt'} and {out / 'metrics.json'}", file=sys.stdout)
    engine.close()
    return 0
