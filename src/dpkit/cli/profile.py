"""`dpkit profile`: per device peak memory by category, time by phase and the imbalance, under any strategy.

    dpkit profile --example wide-output --strategy dp --accelerator cpu --devices 4 --json out.json
    dpkit profile --strategy ddp --accelerator cpu --devices 2 --json out.json   # starts its own processes

The profile is dpkit.tools.profile; this module turns the command line into its ProfileSpec.
"""

from __future__ import annotations

import argparse

from dpkit.cli.flags import from_args
from dpkit.launch import Command
from dpkit.strategies import available_strategies
from dpkit.tools.profile import DTYPES, ProfileSpec
from dpkit.tools.profile import run as run_profile


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("profile", help="per-device memory by category, time by phase, imbalance")
    source = parser.add_argument_group("model and data")
    source.add_argument(
        "--example", default="wide-output", help="built-in example for the model and data (default: wide-output)"
    )
    source.add_argument(
        "--model", help="your model instead, as 'package.module:factory' (factory() returns an nn.Module)"
    )
    source.add_argument(
        "--data", help="your data instead, as 'package.module:loader' (loader(seed) returns x_train, y_train, ...)"
    )
    parser.add_argument("--strategy", default="dp", help=f"{', '.join(available_strategies())} (default: dp)")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--devices", default="auto", help="device count or list; default: all GPUs, else 2 virtual CPU devices"
    )
    parser.add_argument("--steps", type=int, default=3, help="observed steps (default: 3)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="unobserved steps first: optimizer state is created, dp-balanced calibrates (default: 3)",
    )
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


def run(args: argparse.Namespace) -> int:
    command = Command("dpkit.cli.main", tuple(args.argv))
    run_profile(from_args(ProfileSpec, args, progress=not args.no_progress, relaunch=command))
    return 0
