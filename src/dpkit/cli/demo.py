"""`dpkit demo`: train an MLP on the bundled digits with DataParallel, report, save and reload."""

from __future__ import annotations

import argparse

from dpkit.cli.vocabulary import (
    add_accelerator,
    add_batch_size,
    add_devices,
    add_lr,
    add_out,
    add_progress,
    add_seed,
    add_verb,
    global_batch,
    positive_int,
)
from dpkit.devices import resolve_devices
from dpkit.tools.demo import demo

DESCRIPTION = """\
The five-minute tour: train a small MLP on scikit-learn's bundled digits (nothing is downloaded) with
dpkit's DataParallel over every GPU, or over 2 virtual CPU devices without one, then show what each device
did (rows, peak memory: the first device carries more), save a clean checkpoint, reload it into the bare model
and check that it reproduces the trained one; then the lesson's end: the same model under dp and under ddp, each
device's memory and the time per step measured here, and when ddp is the one to prefer. Exits 0 when it ran; a
low accuracy is a note, not a failure."""

EXAMPLES = (
    "dpkit demo",
    "dpkit demo --accelerator cpu --devices 4 --epochs 5",
    "dpkit demo --accelerator cuda --devices 0,1 --batch-size-per-device 128",
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = add_verb(
        subparsers, "demo", "train on the bundled digits with DataParallel and show the report", DESCRIPTION, EXAMPLES
    )
    add_accelerator(parser)
    add_devices(parser)
    parser.add_argument("--epochs", type=positive_int, default=20, help="passes over the training images")
    add_batch_size(parser, "64")
    add_lr(parser, 3e-3, " (Adam's)")
    add_seed(parser)
    add_out(parser, "runs/demo", "the folder for the checkpoint")
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end with the same model under dp and under ddp, memory per device and time per step measured here "
        "(ddp's processes add a few seconds; on two devices or more)",
    )
    add_progress(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    batch_size = global_batch(args, len(resolve_devices(args.accelerator, args.devices)), default=64)
    reproduced = demo(
        accelerator=args.accelerator,
        devices=args.devices,
        epochs=args.epochs,
        batch_size=batch_size,
        lr=args.lr,
        seed=args.seed,
        out=args.out,
        progress=not args.no_progress,
        compare=args.compare,
    )
    # exit 0 when it ran; a low accuracy is a printed note, a checkpoint that does not reload the model a failure
    return 0 if reproduced else 1
