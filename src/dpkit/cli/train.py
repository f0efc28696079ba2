"""`dpkit train`: train an example (or your model factory) with any strategy; write model.pt and metrics.json.

The recipe is dpkit.training.recipe; this module turns the command line into its TrainConfig. With a
strategy that runs one process per device and no launcher around it, the recipe starts this very command
line once per device and waits for the processes.
"""

from __future__ import annotations

import argparse
import shlex

from dpkit.checks import MAX_SEED
from dpkit.cli.flags import from_args
from dpkit.examples import EXAMPLES
from dpkit.launch import Command
from dpkit.precision import PRECISIONS
from dpkit.strategies import available_strategies
from dpkit.training.recipe import TrainConfig
from dpkit.training.recipe import run as run_recipe

# library arguments this command spells differently
SPELLED = {"hang_timeout_seconds": "--hang-timeout"}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train", help="train an example or your model with any strategy; write model.pt and metrics.json"
    )
    parser.add_argument(
        "--example", default="digits", help=f"data (and model) to train: {', '.join(sorted(EXAMPLES))} (default digits)"
    )
    parser.add_argument(
        "--model", default=None, help="your model instead of the example's, as 'package.module:factory'"
    )
    parser.add_argument(
        "--data",
        default=None,
        help="your data instead of the example's, as 'package.module:loader'; "
        "loader(seed) returns x_train, y_train, x_test, y_test (class labels as integers)",
    )
    parser.add_argument("--strategy", default="single", choices=available_strategies())
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--devices",
        default="auto",
        help="device count or list (default: 1 for single; all GPUs, else 2 virtual CPU devices)",
    )
    parser.add_argument(
        "--steps", type=int, default=100, help="optimizer steps in total, a resumed run included (default 100)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=64, help="global batch size, split across devices (default 64)"
    )
    parser.add_argument("--seed", type=int, default=0, help=f"0 … {MAX_SEED} (default 0)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    parser.add_argument("--precision", default="32", choices=list(PRECISIONS))
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--out", default="runs/train", help="folder for model.pt and metrics.json (default runs/train)")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="K",
        help="save the resumable state in OUT/state every K steps, at the last step, and when stopped by "
        "SIGINT/SIGTERM/SIGHUP",
    )
    parser.add_argument("--keep", type=int, default=2, help="saved states to keep (default 2)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run saved in --out up to --steps in total (a run stopped at its end is completed, "
        "a finished one left as it is)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="ddp: restart the processes this many times after a failure, "
        "resuming from the last saved state (default 0)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="ddp: stop and name a process that makes no progress for this long (default: off)",
    )
    parser.add_argument(
        "--force", action="store_true", help="ddp: start more processes than a sane multiple of the cores"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    argv = list(args.argv)
    resume_argv = [a for a in argv if a != "--overwrite"] + ([] if "--resume" in argv else ["--resume"])
    return from_args(
        TrainConfig,
        args,
        hang_timeout_seconds=args.hang_timeout,
        progress=not args.no_progress,
        relaunch=Command("dpkit.cli.main", tuple(argv)),
        resume_command="dpkit " + shlex.join(resume_argv),
    )


def run(args: argparse.Namespace) -> int:
    run_recipe(config_from_args(args))
    return 0
