"""`dpkit bench`: one model under several strategies and device counts, in one command.

For each configuration: samples/s, speed-up and efficiency against the measured one-device run, and where the
lost efficiency went by phase. The JSON is what `dpkit plan --calibration` fits to.
"""

from __future__ import annotations

import argparse

from dpkit.checks import check_output_file
from dpkit.cli.flags import from_args
from dpkit.cli.vocabulary import (
    add_accelerator,
    add_batch_size,
    add_compress,
    add_device_counts,
    add_lr,
    add_model_source,
    add_optimizer,
    add_outputs,
    add_precision,
    add_progress,
    add_seed,
    add_steps,
    add_strategies,
    add_verb,
    add_warmup,
)
from dpkit.recipe.optimization import OPTIMIZERS
from dpkit.strategies.compression import parse_compression
from dpkit.tools.bench.run import run_bench
from dpkit.tools.bench.spec import BenchSpec

DESCRIPTION = """\
Measure one model under several strategies and device counts in one run: every configuration's steps are
interleaved round by round, so a busy machine slows them alike and the ratios hold. For each: samples/s
(median step), speed-up and efficiency against the measured one-device run, and the lost efficiency by phase
(scatter, replicate, gather, reduce, ...). --batch-size-per-device (the default, 64) grows the global batch
with the devices; --batch-size keeps one global batch for every count. The JSON feeds dpkit plan --calibration."""

EXAMPLES = (
    "dpkit bench --device-counts 1,2 --strategies single,dp,ddp",
    "dpkit bench --example wide-output --device-counts 1,2,3 --batch-size-per-device 64 --json bench.json "
    "--png bench.png",
    "dpkit bench --batch-size 192 --device-counts 1,2,3    # one global batch: strong scaling",
    "dpkit plan --model mymodels:build --input-shape 64 --calibration bench.json",
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = add_verb(
        subparsers,
        "bench",
        "measure samples/s, speed-up and lost efficiency by phase per strategy and device count",
        DESCRIPTION,
        EXAMPLES,
    )
    add_model_source(parser, "wide-output", input_shape=True)
    add_strategies(parser)
    add_device_counts(parser, "1,2,3")
    add_accelerator(parser)
    add_precision(parser)
    add_compress(parser)
    add_batch_size(parser, "64 per device")
    add_steps(parser, 10, "measured steps per configuration")
    add_warmup(parser, 3, "unmeasured steps first")
    parser.add_argument("--observed-steps", type=int, default=3, help="extra steps timed by phase")
    parser.add_argument(
        "--threads-per-device",
        type=int,
        default=1,
        help="intra-op threads per virtual CPU device (0: dpkit's fair share of the cores)",
    )
    add_optimizer(parser, "adam", OPTIMIZERS)
    add_lr(parser, 1e-3)
    add_seed(parser)
    add_outputs(parser, png="throughput and per-phase plots")
    add_progress(parser)
    return parser


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    per_device = args.batch_size_per_device
    if args.batch_size is None and per_device is None:
        per_device = 64
    return from_args(
        BenchSpec,
        args,
        example=None if args.model and (args.data or args.input_shape) else args.example,
        strategies=args.strategies,
        device_counts=args.device_counts,
        batch_size_per_device=per_device,
        progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    for name in ("json", "png"):  # before anything is measured
        check_output_file(getattr(args, name), name)
    result = run_bench(spec_from_args(args))
    machine = result.machine
    print(
        f"dpkit bench: {result.profile['name']}, {result.spec.batch_description()}, median of "
        f"{result.spec.steps} steps after {result.spec.warmup} warm-up, on {machine['accelerator']} "
        f"({machine['cores']} cores, load average {machine.get('load_average') or 0:.1f})"
    )
    print(result.format_table())
    spec = result.spec
    if parse_compression(spec.compress).compresses:
        compressed = [name for name in spec.strategies if spec.compresses(name)]
        plain = [name for name in spec.strategies if not spec.compresses(name)]
        print(
            f"compressed with {spec.compress}: {', '.join(compressed)}"
            + (f"; as they are (they take no {spec.compress}): {', '.join(plain)}" if plain else "")
        )
    if args.json:
        print(f"wrote {result.save_json(args.json)}")
    if args.png:
        print(f"wrote {result.save_png(args.png)}")
    return 0
