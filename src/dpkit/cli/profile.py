"""`dpkit profile`: per device peak memory by category, time by phase and the imbalance, under any strategy.

The profile is dpkit.tools.profile; this module turns the command line into its ProfileSpec.
"""

from __future__ import annotations

import argparse

from dpkit.cli.flags import from_args
from dpkit.cli.vocabulary import (
    add_accelerator,
    add_batch_size,
    add_compile,
    add_compress,
    add_devices,
    add_lr,
    add_model_source,
    add_optimizer,
    add_outputs,
    add_precision,
    add_progress,
    add_seed,
    add_steps,
    add_strategies,
    add_strategy,
    add_verb,
    add_warmup,
)
from dpkit.launch import Command
from dpkit.tools.profile import OPTIMIZERS, PRECISIONS, ProfileSpec
from dpkit.tools.profile import run as run_profile
from dpkit.tools.profile_strategies import run_strategies

DESCRIPTION = """\
Run a few training steps under one strategy and show, for every device, the peak memory by category
(parameters, gradients, optimizer state, activations, the outputs gathered on the first device, ...) and the
time of each phase (scatter, replicate, forward, gather, loss, backward, reduce, optimizer, all-gather, ...),
with the imbalance between devices: the first device's extra load under dp is measured, not described.
Strategies with a process per device start their processes themselves; rank 0 reports for all. With
--strategies dp,ddp each strategy runs in turn on the same model, data and devices, and one table shows them side
by side: each device's peak memory and time (the JSON holds a report per strategy under "runs")."""

EXAMPLES = (
    "dpkit profile --strategy dp --devices 2",
    "dpkit profile --example digits --strategies dp,ddp --devices 2 --png both.png   # side by side",
    "dpkit profile --example wide-output --strategy dp-balanced --devices 4 --json out.json --png memory.png",
    "dpkit profile --strategy ddp --devices 2 --trace trace.json    # open in https://ui.perfetto.dev",
    "dpkit profile --model mymodels:build --data mydata:load --strategy fsdp --batch-size-per-device 32",
    "dpkit profile --model mymodels:build --input-shape 64 --strategy dp --devices 2   # synthetic rows",
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = add_verb(
        subparsers,
        "profile",
        "per-device memory by category, time by phase, imbalance",
        DESCRIPTION,
        EXAMPLES,
    )
    add_model_source(parser, "wide-output", input_shape=True)
    which = parser.add_mutually_exclusive_group()
    add_strategy(which, "dp")
    add_strategies(which, every_by_default=False, help_more=": each profiled in turn, shown side by side")
    add_accelerator(parser)
    add_devices(parser)
    add_precision(parser, PRECISIONS)
    add_compile(parser)
    add_compress(parser)
    add_steps(parser, 3, "observed steps")
    add_warmup(parser, 3, "unobserved steps first: optimizer state is created, dp-balanced calibrates")
    add_batch_size(
        parser, "64, as train's; 64 per device for the wide-output example, where dp-balanced can even the devices out"
    )
    add_lr(parser, 1e-3)
    add_optimizer(parser, "adam", OPTIMIZERS)
    add_seed(parser)
    add_outputs(
        parser,
        png="a stacked bar chart of memory by category per device (with --strategies: a column per strategy, memory "
        "by category and time by phase)",
    )
    parser.add_argument(
        "--trace",
        help="write a Chrome trace (open in https://ui.perfetto.dev) here: each device's phases and, under ddp and "
        "fsdp, the collectives its rank issued (with --strategies: one per strategy, trace-dp.json, ...)",
    )
    add_progress(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    command = Command("dpkit.cli.main", tuple(args.argv))
    spec = from_args(
        ProfileSpec,
        args,
        progress=not args.no_progress,
        relaunch=command,
    )
    if args.strategies:
        run_strategies(spec, args.strategies)
    else:
        run_profile(spec)
    return 0
