"""`dpkit demo`: train an MLP on the bundled digits with DataParallel, report, save and reload."""

from __future__ import annotations

import argparse

from dpkit.tools.demo import demo


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("demo", help="train on the bundled digits with DataParallel and show the report")
    parser.add_argument(
        "--accelerator",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="default: every GPU if any, else 2 virtual CPU devices",
    )
    parser.add_argument(
        "--devices", default="auto", help="device count or list; default: all GPUs, else 2 virtual CPU devices"
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/demo", help="folder for the checkpoint (default: runs/demo)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def run(args: argparse.Namespace) -> int:
    reproduced = demo(
        accelerator=args.accelerator,
        devices=args.devices,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        out=args.out,
        progress=not args.no_progress,
    )
    # exit 0 when it ran; a low accuracy is a printed note, a checkpoint that does not reload the model a failure
    return 0 if reproduced else 1
