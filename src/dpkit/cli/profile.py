"""`dpkit profile`: run a few steps of a model under a strategy and report, per device, peak memory
by category, time by phase and the imbalance (max/mean of per-device peaks).

    dpkit profile --example wide-output --strategy dp --accelerator cpu --devices 4 --json out.json

Outputs: a table in the terminal, and on request a JSON file (--json), a stacked bar chart of memory
by category per device (--png) and a Chrome trace of the phases on each device's track (--trace).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

import dpkit
from dpkit.cli.arguments import output_file
from dpkit.devices import resolve_devices
from dpkit.examples import get_example, load_factory
from dpkit.observe import Observer, Report

PROFILED_STRATEGIES = ("single", "dp", "dp-balanced")
ENGINE_STRATEGIES = ("replicated", "ddp")
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("profile", help="per-device memory by category, time by phase, imbalance")
    source = parser.add_argument_group("model and data")
    source.add_argument("--example", default="wide-output", help="built-in example for the model and data (default: wide-output)")
    source.add_argument("--model", help="your model instead, as 'package.module:factory' (factory() returns an nn.Module)")
    source.add_argument("--data", help="your data instead, as 'package.module:loader' (loader(seed) returns x_train, y_train, ...)")
    parser.add_argument("--strategy", default="dp", help="single, dp or dp-balanced (default: dp)")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--devices", default="auto", help="device count or list; default: all GPUs, else 2 virtual CPU devices")
    parser.add_argument("--steps", type=int, default=3, help="observed steps (default: 3)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="unobserved steps first: optimizer state is created, dp-balanced calibrates (default: 3)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report as JSON here")
    parser.add_argument("--png", help="write a stacked bar chart of memory by category per device here")
    parser.add_argument("--trace", help="write a Chrome trace (open in https://ui.perfetto.dev) here")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def criterion_for(target: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross-entropy for class labels, mean squared error for anything else."""
    return F.cross_entropy if not target.is_floating_point() else F.mse_loss


def check_args(args: argparse.Namespace) -> None:
    for flag in ("--json", "--png", "--trace"):  # a folder or an unwritable place is found now, not after profiling
        output_file(flag, getattr(args, flag[2:]))
    if args.strategy in ENGINE_STRATEGIES:
        raise ValueError(f"--strategy: {args.strategy!r} is not profiled yet (it runs through the Engine); "
                         f"use one of {', '.join(PROFILED_STRATEGIES)}")
    if args.strategy not in PROFILED_STRATEGIES:
        raise ValueError(f"--strategy: unknown strategy {args.strategy!r}; use one of {', '.join(PROFILED_STRATEGIES)}")
    for flag, value, low in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--batch-size", args.batch_size, 1)):
        if value < low:
            raise ValueError(f"{flag}: expected at least {low}, got {value}")
    if args.strategy == "dp-balanced" and args.warmup < 3:
        logging.getLogger("dpkit").warning("--warmup %d: dp-balanced calibrates during its first 3 steps, so the observed "
                                           "steps include unbalanced ones; use --warmup 3 or more", args.warmup)


def load_model_and_data(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    example = None if (args.model and args.data) else get_example(args.example)
    model = load_factory(args.model)() if args.model else example.build_model()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"--model: the factory returned {type(model).__name__}, expected a torch.nn.Module")
    data = load_factory(args.data)(args.seed) if args.data else example.load_data(args.seed)
    x, y = data[0], data[1]
    if len(x) < args.batch_size:
        raise ValueError(f"--batch-size: {args.batch_size} rows but the data has only {len(x)}; use a smaller batch")
    return model, x, y


def profile(args: argparse.Namespace) -> tuple[Report, float]:
    """Run warm-up and observed steps; the report of the observed ones and the last loss."""
    check_args(args)
    devices = resolve_devices(args.accelerator, args.devices)
    if args.strategy == "single":
        devices = devices[:1]
    torch.manual_seed(args.seed)
    model, x, y = load_model_and_data(args)
    dtype = DTYPES[args.dtype]
    primary = devices[0]
    model = model.to(device=primary, dtype=dtype)
    x = x.to(dtype) if x.is_floating_point() else x
    y = y.to(dtype) if y.is_floating_point() else y
    criterion = criterion_for(y)
    if args.strategy == "dp-balanced":
        runner: Any = dpkit.DataParallel(model, devices, loss_fn=criterion, balance="memory")
    elif args.strategy == "dp":
        runner = dpkit.DataParallel(model, devices)
    else:
        runner = model
    optimizer = (torch.optim.Adam(model.parameters(), lr=args.lr) if args.optimizer == "adam"
                 else torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed))
    batches = len(x) // args.batch_size

    def step(i: int, observer: Observer | None) -> float:
        index = order[(i % batches) * args.batch_size:][:args.batch_size]
        xb, yb = x[index].to(primary), y[index].to(primary)
        optimizer.zero_grad(set_to_none=True)
        if args.strategy == "dp-balanced":
            loss = runner(xb, target=yb)
        else:
            output = runner(xb)
            with observer.phase("loss") if observer else contextlib.nullcontext():
                loss = criterion(output, yb)
            del output  # as in a training loop: only the loss's graph holds on to it
        with observer.phase("backward") if observer else contextlib.nullcontext():
            loss.backward()
        optimizer.step()  # the observer times and charges it through optimizer hooks
        return loss.item()

    total = args.warmup + args.steps
    with tqdm(total=total, desc=f"profile {args.strategy}", unit="step", disable=args.no_progress) as bar:
        for i in range(args.warmup):
            step(i, None)
            bar.update()
        with Observer(primary, models=[model], optimizers=[optimizer]) as observer:
            for i in range(args.warmup, total):
                last_loss = step(i, observer)
                bar.update()
    report = observer.report()
    if args.strategy == "single":
        report.devices = [d for d in report.devices if d.device == report.devices[0].device]
        report.devices[0].rows = args.batch_size
        report.steps = args.steps
    report.meta = {
        "example": None if args.model else args.example, "model": args.model, "strategy": args.strategy,
        "devices_requested": [str(d) for d in devices], "batch_size": args.batch_size, "dtype": args.dtype,
        "optimizer": args.optimizer, "warmup_steps": args.warmup, "seed": args.seed, "last_loss": last_loss,
    }
    return report, last_loss


def run(args: argparse.Namespace) -> int:
    report, last_loss = profile(args)
    devices = ", ".join(d.device for d in report.devices)
    print(f"dpkit profile: {report.meta['model'] or args.example}, strategy {args.strategy}, batch {args.batch_size}, "
          f"{args.dtype}, {args.steps} observed step(s) after {args.warmup} warm-up, on {devices}")
    print(report.format_table())
    print(f"last loss: {last_loss:.6f}")
    if args.json:
        print(f"wrote {report.save_json(args.json)}")
    if args.png:
        print(f"wrote {report.save_png(args.png, title=f'{args.strategy}: memory by category at each device peak')}")
    if args.trace:
        print(f"wrote {report.save_trace(args.trace)}")
    return 0
