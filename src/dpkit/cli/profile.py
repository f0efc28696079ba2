"""`dpkit profile`: run a few steps of a model under any strategy, through the Engine, and report per
device peak memory by category, time by phase and the imbalance (max/mean of per-device peaks).

    dpkit profile --example wide-output --strategy dp --accelerator cpu --devices 4 --json out.json
    dpkit profile --strategy ddp --accelerator cpu --devices 2 --json out.json   # starts its own processes

Outputs: a table in the terminal, and on request a JSON file (--json), a stacked bar chart of memory
by category per device (--png) and a Chrome trace of the phases on each device's track (--trace).
Under ddp every process measures itself and rank 0 writes one report holding every rank's devices.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from dpkit.cli.flags import output_file
from dpkit.devices import resolve_devices
from dpkit.training.engine import Engine
from dpkit.examples import get_example, load_factory
from dpkit.launch import launch, launched
from dpkit.observe import Observer, Report
from dpkit.parallel.balance import CALIBRATION_CALLS
from dpkit.strategies import available_strategies

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("profile", help="per-device memory by category, time by phase, imbalance")
    source = parser.add_argument_group("model and data")
    source.add_argument("--example", default="wide-output", help="built-in example for the model and data (default: wide-output)")
    source.add_argument("--model", help="your model instead, as 'package.module:factory' (factory() returns an nn.Module)")
    source.add_argument("--data", help="your data instead, as 'package.module:loader' (loader(seed) returns x_train, y_train, ...)")
    parser.add_argument("--strategy", default="dp", help="single, dp, dp-balanced, replicated or ddp (default: dp)")
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
    parser.set_defaults(_parser=parser)  # to relaunch itself under ddp with the same options
    return parser


def criterion_for(target: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross-entropy for class labels, mean squared error for anything else."""
    return F.cross_entropy if not target.is_floating_point() else F.mse_loss


def check_args(args: argparse.Namespace) -> None:
    for flag in ("--json", "--png", "--trace"):  # a folder or an unwritable place is found now, not after profiling
        output_file(flag, getattr(args, flag[2:]))
    if args.strategy not in available_strategies():
        raise ValueError(f"--strategy: unknown strategy {args.strategy!r}; use one of {', '.join(available_strategies())}")
    for flag, value, low in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--batch-size", args.batch_size, 1)):
        if value < low:
            raise ValueError(f"{flag}: expected at least {low}, got {value}")
    calibration = CALIBRATION_CALLS["memory"]
    if args.strategy == "dp-balanced" and args.warmup < calibration:
        logging.getLogger("dpkit").warning("--warmup %d: dp-balanced calibrates during its first %d steps, so the observed "
                                           "steps include unbalanced ones; use --warmup %d or more", args.warmup, calibration, calibration)


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


def batches_forever(loader: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def profile(args: argparse.Namespace) -> tuple[Report | None, float]:
    """Run warm-up and observed steps through the Engine; the report of the observed ones (every rank's
    devices under ddp; None on the other ranks) and the last loss (the global batch's)."""
    check_args(args)
    devices = resolve_devices(args.accelerator, args.devices)
    if args.strategy == "single":
        devices = devices[:1]
    torch.manual_seed(args.seed)
    model, x, y = load_model_and_data(args)
    dtype = DTYPES[args.dtype]
    model = model.to(dtype=dtype)
    x = x.to(dtype) if x.is_floating_point() else x
    y = y.to(dtype) if y.is_floating_point() else y
    optimizer = (torch.optim.Adam(model.parameters(), lr=args.lr) if args.optimizer == "adam"
                 else torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))
    # replicated on virtual CPU devices would share one copy of the weights among its replicas (faster
    # here); the profile measures the layout GPUs have, a copy and an optimizer state per device
    options = {"share_weights": False} if args.strategy == "replicated" else {}
    engine = Engine(strategy=args.strategy, accelerator=devices[0].type, devices=devices, progress=not args.no_progress, **options)
    try:
        model, engine_optimizer = engine.setup(model, optimizer)
        criterion = engine.setup_criterion(criterion_for(y))
        sampler = RandomSampler(range(len(x)), generator=torch.Generator().manual_seed(args.seed))
        loader = engine.setup_dataloader(DataLoader(TensorDataset(x, y), batch_size=args.batch_size, sampler=sampler, drop_last=True))
        batches = batches_forever(loader)

        def step() -> float:
            xb, yb = next(batches)
            engine_optimizer.zero_grad(set_to_none=True)
            loss = criterion(model(xb), yb)
            engine.backward(loss)
            engine_optimizer.step()  # timed and charged by the observer's optimizer hooks
            return float(engine.reduce(loss.detach(), "mean", weight=len(yb)))

        total = args.warmup + args.steps
        with engine.progress(total=total, desc=f"profile {args.strategy}", unit="step") as bar:
            for _ in range(args.warmup):
                step()
                bar.update()
            with Observer(engine.device, models=engine.model_copies(), optimizers=[optimizer]) as observer:
                for _ in range(args.steps):
                    last_loss = step()
                    bar.update()
        reports = engine.gather_object(observer.report())
        writes = engine.is_global_zero
    finally:
        engine.close()
    if not writes:
        return None, last_loss
    report = Report.merged(reports) if len(reports) > 1 else reports[0]
    report.meta = {
        "example": None if args.model else args.example, "model": args.model, "strategy": args.strategy,
        "devices_requested": [str(d) for d in devices], "processes": len(reports), "batch_size": args.batch_size,
        "dtype": args.dtype, "optimizer": args.optimizer, "warmup_steps": args.warmup, "seed": args.seed,
        "last_loss": last_loss,
    }
    return report, last_loss


def run(args: argparse.Namespace) -> int:
    if args.strategy == "ddp" and not launched():
        check_args(args)
        n_devices = len(resolve_devices(args.accelerator, args.devices))
        launch("dpkit.cli.main", list(args.argv), nproc_per_node=n_devices, module=True)  # its own command line
        return 0  # rank 0 printed the report and wrote the files
    report, last_loss = profile(args)
    if report is None:  # a ddp rank other than 0: rank 0 writes every rank's devices
        return 0
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
