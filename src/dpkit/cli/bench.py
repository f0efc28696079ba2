"""`dpkit bench`: one model under several strategies and device counts, in one command.

    dpkit bench --example wide-output --strategies single,dp,dp-balanced,replicated,ddp,fsdp --devices 1,2,3 \\
                --batch-size-per-device 64 --json bench.json --png bench.png

For each configuration: samples/s, speed-up and efficiency against the measured one-device run, and
where the lost efficiency went by phase. The JSON is what `dpkit plan --calibration` fits to.
"""

from __future__ import annotations

import argparse

from dpkit.cli.flags import comma_ints, from_args
from dpkit.strategies import available_strategies
from dpkit.tools.bench import BenchSpec, run_bench

# library arguments this command spells differently
SPELLED = {"device_counts": "--devices"}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench", help="measure samples/s, speed-up and lost efficiency by phase per strategy and device count"
    )
    source = parser.add_argument_group("model and data")
    source.add_argument(
        "--example", default="wide-output", help="built-in example for the model and data (default: wide-output)"
    )
    source.add_argument("--model", help="your model instead, as 'package.module:factory'")
    source.add_argument(
        "--data", help="your data, as 'package.module:loader' (loader(seed) returns x_train, y_train, ...)"
    )
    source.add_argument(
        "--input-shape", help="with --model and no --data: synthetic inputs of this per-sample shape, e.g. 3,32,32"
    )
    parser.add_argument(
        "--strategies", default=",".join(available_strategies()), help="comma-separated (default: every strategy)"
    )
    parser.add_argument("--devices", default="1,2,3", help="device counts to run, comma-separated (default: 1,2,3)")
    parser.add_argument(
        "--accelerator", default="cpu", choices=["cpu", "cuda"], help="cpu: virtual CPU devices (default)"
    )
    parser.add_argument(
        "--batch-size-per-device", type=int, default=64, help="samples per device per step (default: 64)"
    )
    parser.add_argument("--steps", type=int, default=10, help="measured steps per configuration (default: 10)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (default: 3)")
    parser.add_argument("--observed-steps", type=int, default=3, help="extra steps timed by phase (default: 3)")
    parser.add_argument(
        "--threads-per-device",
        type=int,
        default=1,
        help="intra-op threads per virtual CPU device (default: 1; 0: dpkit's fair share of the cores)",
    )
    parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results as JSON here (input for dpkit plan --calibration)")
    parser.add_argument("--png", help="write throughput and per-phase plots here")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    return from_args(
        BenchSpec,
        args,
        example=None if args.model and (args.data or args.input_shape) else args.example,
        input_shape=tuple(comma_ints("--input-shape", args.input_shape)) if args.input_shape else None,
        strategies=[s.strip() for s in args.strategies.split(",") if s.strip()],
        device_counts=comma_ints("--devices", args.devices),
        progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    result = run_bench(spec_from_args(args))
    machine = result.machine
    print(
        f"dpkit bench: {result.profile['name']}, batch {result.spec.batch_size_per_device} per device, median of "
        f"{result.spec.steps} steps after {result.spec.warmup} warm-up, on {machine['accelerator']} "
        f"({machine['cores']} cores, load average {machine.get('load_average') or 0:.1f})"
    )
    print(result.format_table())
    if args.json:
        print(f"wrote {result.save_json(args.json)}")
    if args.png:
        print(f"wrote {result.save_png(args.png)}")
    return 0
