"""`dpkit plan`: predict step time, throughput, scaling and memory per strategy and device count, and
recommend one, before running anything.

The formulas and their sources are in docs/cost-model.md. When nothing fits, the recommendation names no
strategy (printed as "recommendation: none", JSON "strategy": null) and its reasons, with "would_fit" in the
JSON, say what would: the device count on which the sharded strategy fits, CPU offload, a smaller batch.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from dpkit.checks import check_output_file
from dpkit.cli import vocabulary
from dpkit.plan.catalogue import PRECISIONS, Catalogue, Link
from dpkit.plan.configuration import BatchSize, Hardware
from dpkit.plan.constants import OPTIMIZER_STATE_BYTES_PER_PARAMETER, CostConstants
from dpkit.plan.cost_model import compression_takers
from dpkit.plan.doctor_links import (
    calibration_files,
    check_measured_machine,
    measured_link,
    measured_words,
    with_measured_link,
)
from dpkit.plan.planner import make_plan
from dpkit.plan.profiles import BUILTIN_PROFILES, ModelProfile, builtin_profile, given_profile, measure_model
from dpkit.plan.tables import wrap
from dpkit.strategies import PER_DEVICE, strategy_class
from dpkit.strategies.compression import parse_compression

# library arguments this command spells differently
SPELLED = {
    "batch_per_device": "--batch-size-per-device",
    "strategy": "--strategies",
    "devices": "--device-counts",
    "catalogue_file": "--catalogue",
}

DESCRIPTION = """\
Predict, before running anything, how long one training step takes under each strategy on each
device count, where the time goes (phase by phase), how much memory the fullest device needs and the
largest batch that fits; then recommend a strategy and say why, what limits it and what would change
the answer. The hardware comes from the catalogue (`dpkit catalogue` lists it; --link defaults to
the GPU's usual link), or from this machine with --calibration. The formulas and their sources are
in docs/cost-model.md."""

EXAMPLES = [
    "dpkit plan --model gpt2-124m --gpu h100-sxm --batch-size-per-device 8 --json plan.json",
    "dpkit plan --model llama-7b --gpu a100-80gb-sxm --batch-size 8 --precision bf16-mixed",
    "dpkit plan --model resnet50 --gpu rtx-3090 --link pcie4 --batch-size 256 --png plan.png",
    "dpkit plan --params 125e6 --flops-per-sample 2.5e11 --gpu h100-pcie --batch-size-per-device 16",
    "dpkit plan --model mypkg.models:build --input-shape 64 --calibration bench.json --batch-size 256",
    "dpkit plan --example launch-bound --gpu a100-80gb-sxm --batch-size 32 --device-counts 1,2",
    "dpkit plan --model gpt2-124m --gpu h100-sxm --batch-size-per-device 8 --strategy ddp",
    "dpkit plan --params 1e9 --gpu h100-sxm --nodes 2 --network eth-10g --batch-size-per-device 8 --compress bf16",
    "dpkit plan --model gpt2-124m --gpu a100-80gb-pcie --batch-size-per-device 4 --accumulate 8",
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = vocabulary.add_verb(
        subparsers,
        "plan",
        "predict step time, scaling and memory per strategy; recommend one",
        DESCRIPTION,
        EXAMPLES,
    )
    model = parser.add_argument_group("model")
    vocabulary._tag(
        model.add_argument(
            "--model",
            help=vocabulary.VOCABULARY["--model"] + f", or a built-in profile: {', '.join(BUILTIN_PROFILES)}",
        ),
        "--model",
    )
    from dpkit.examples import EXAMPLES as BUILT_IN_EXAMPLES

    vocabulary._tag(
        model.add_argument(
            "--example",
            help=vocabulary.VOCABULARY["--example"]
            + f" (its model, traced; instead of --model): {', '.join(sorted(BUILT_IN_EXAMPLES))}",
        ),
        "--example",
    )
    vocabulary.add_input_shape(model, " (a factory needs it; it scales a CNN profile)")
    model.add_argument("--seq-len", type=vocabulary.positive_int, help="sequence length for a transformer profile")
    model.add_argument("--params", type=float, help="parameter count, instead of --model (e.g. 125e6)")
    model.add_argument("--flops-per-sample", type=float, help="forward FLOPs per sample (with --params)")
    model.add_argument("--activation-bytes-per-sample", type=float, help="activation bytes per sample (with --params)")
    model.add_argument(
        "--output-bytes-per-sample", type=float, default=4000.0, help="output bytes per sample (with --params)"
    )
    model.add_argument(
        "--input-bytes-per-sample",
        type=float,
        default=3 * 224 * 224 * 4.0,
        help="input bytes per sample (with --params)",
    )
    model.add_argument(
        "--kernels-per-forward", type=int, default=200, help="kernels launched per forward (with --params)"
    )
    model.add_argument(
        "--largest-unit-params",
        type=float,
        help="parameters of the largest unit a sharded strategy gathers at once, e.g. one transformer block "
        "(with --params; default: the whole model)",
    )
    hardware = parser.add_argument_group("hardware")
    hardware.add_argument(
        "--gpu",
        help="a GPU of the catalogue, e.g. h100-sxm (not needed with a CPU --calibration; dpkit catalogue gpus)",
    )
    vocabulary.add_link(hardware, " (default: the GPU's usual link, from the catalogue)")
    hardware.add_argument(
        "--nodes", type=vocabulary.positive_int, default=1, help="nodes (only ddp and fsdp span them)"
    )
    hardware.add_argument(
        "--network", help="the network between nodes, e.g. ib-200g (with --nodes > 1; dpkit catalogue networks)"
    )
    vocabulary.add_catalogue(hardware)
    run_group = parser.add_argument_group("what to plan")
    vocabulary.add_device_counts(run_group, "1,2,4,8")
    vocabulary.add_batch_size(run_group, "none: give --batch-size or --batch-size-per-device")
    which = run_group.add_mutually_exclusive_group()
    vocabulary.add_strategy(which, None, help_more=" to plan alone, instead of --strategies")
    vocabulary.add_strategies(which)
    vocabulary.add_strategy_settings(run_group)
    vocabulary.add_precision(run_group, choices=PRECISIONS)  # the catalogue's: tf32 is a rate, not a mode
    vocabulary.add_optimizer(run_group, "adam", choices=tuple(OPTIMIZER_STATE_BYTES_PER_PARAMETER))
    vocabulary.add_compress(run_group)
    vocabulary.add_accumulate(run_group)
    run_group.add_argument(
        "--calibration",
        action="append",
        help="a dpkit bench JSON to fit the compute and per-step constants to; repeat it to fit several runs at "
        "once (a launch-bound model and a compute-bound one tell the per-step costs from the arithmetic); or a "
        "dpkit doctor JSON, whose measured all-reduce replaces the catalogue's link (docs/cost-model.md)",
    )
    vocabulary.add_outputs(parser, png="throughput per strategy and the step by phase")
    return parser


def load_profile(args: argparse.Namespace) -> ModelProfile:
    given = [flag for flag, value in (("--example", args.example), ("--model", args.model)) if value]
    if args.params is not None:
        given.append("--params")
    if len(given) > 1:
        raise ValueError(f"{given[0]}/{given[1]}: give one model: --example, --model or the numbers with --params")
    if args.example:
        from dpkit.examples import get_example

        example = get_example(args.example)
        x = example.load_data(0)[0]
        return measure_model(example.build_model, tuple(x.shape[1:]), input_dtype=x.dtype, name=args.example)
    if args.largest_unit_params is not None and args.params is None:
        raise ValueError("--largest-unit-params: goes with --params (a model's units are counted from the model)")
    if args.params is not None:
        return given_profile(
            args.params,
            args.flops_per_sample,
            name=f"{args.params:.3g}-parameter model",
            kernels_per_forward=args.kernels_per_forward,
            activation_bytes_per_sample=args.activation_bytes_per_sample,
            output_bytes_per_sample=args.output_bytes_per_sample,
            input_bytes_per_sample=args.input_bytes_per_sample,
            largest_unit_parameters=args.largest_unit_params,
        )
    if not args.model:
        raise ValueError(
            "--model: give a built-in profile, 'package.module:factory', --example NAME, or the numbers with --params"
        )
    shape = tuple(args.input_shape) if args.input_shape else None
    if ":" in args.model:
        from dpkit.examples import load_factory

        if shape is None:
            raise ValueError(
                f"--input-shape: the factory {args.model!r} needs the per-sample input shape, "
                "e.g. --input-shape 3,224,224"
            )
        return measure_model(load_factory(args.model), shape, name=args.model)
    return builtin_profile(args.model, shape, args.seq_len)


def batch_from_args(args: argparse.Namespace) -> BatchSize:
    """--batch-size (global) or --batch-size-per-device, checked against the most devices planned."""
    if args.batch_size is None and args.batch_size_per_device is None:
        raise ValueError(
            "--batch-size: give the batch, --batch-size N (over all devices, split across them) "
            "or --batch-size-per-device N"
        )
    if args.batch_size_per_device is not None:
        return BatchSize(args.batch_size_per_device)
    spans = args.nodes > 1 and any(strategy_class(s).traits.processes == PER_DEVICE for s in args.strategies)
    most = max(args.device_counts) * (args.nodes if spans else 1)
    if args.batch_size < most:
        raise ValueError(
            f"--batch-size: {args.batch_size} samples cannot give each of {most} devices one "
            f"(--device-counts {','.join(map(str, args.device_counts))}"
            + (f" on {args.nodes} nodes" if spans else "")
            + f"); give at least {most}, or --batch-size-per-device"
        )
    return BatchSize(args.batch_size, per_device=False)


def hardware_from_args(args: argparse.Namespace, catalogue: Catalogue) -> tuple[Hardware | None, str]:
    """The catalogue's hardware named by --gpu, --link (default: the GPU's usual one), --nodes and --network,
    with a note on the link; None when this machine is planned from a CPU --calibration alone."""
    if args.nodes > 1 and not args.network:
        raise ValueError(
            "--network: --nodes > 1 needs the network between nodes, e.g. --network ib-200g "
            "(`dpkit catalogue networks` lists them)"
        )
    network = catalogue.network(args.network) if args.network else None
    if not args.gpu:
        if args.link:
            raise ValueError(
                "--gpu: --link joins GPUs of the catalogue; name them too, e.g. --gpu h100-sxm "
                "(`dpkit catalogue gpus` lists them)"
            )
        if not args.calibration:
            raise ValueError(
                "--gpu: name a GPU of the catalogue, e.g. --gpu h100-sxm (`dpkit catalogue gpus` lists them), "
                "or plan for this machine with --calibration bench.json"
            )
        return None, ""
    gpu = catalogue.gpu(args.gpu)
    usual = catalogue.usual_link(gpu)
    if args.link:
        link = catalogue.link(args.link)
        note = (
            ""
            if not gpu.links or link.name in gpu.links
            else f" (not one of {gpu.name}'s links in the catalogue: {', '.join(gpu.links)})"
        )
    elif usual is None:
        raise ValueError(
            f"--link: the catalogue names no usual link for {gpu.name}; name one, e.g. --link pcie4 "
            "(`dpkit catalogue links` lists them)"
        )
    else:
        link, note = usual, f" (the usual one for {gpu.name}; --link to change)"
    return Hardware(gpu, link, network, args.nodes), note


def _parameters(count: float) -> str:
    """124.0M, 6.74B, 38,390."""
    for suffix, scale in (("B", 1e9), ("M", 1e6)):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}" if count < 100 * scale else f"{count / scale:,.1f}{suffix}"
    return f"{count:,.0f}"


def _flops(flops: float) -> str:
    """272 GFLOP, 28 TFLOP, 75.8 kFLOP: three significant figures with an SI prefix."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.3g} {prefix}FLOP"
    return f"{flops:.3g} FLOP"


# a strategy setting's flag -> the strategy option it gives (the strategies that take it plan with it)
SETTINGS = {"zero_stage": "stage", "shard_size": "shard_size"}


def options_from_settings(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """--zero-stage and --shard-size as the options of the planned strategies that take them; one line when no
    planned strategy takes a setting given."""
    options: dict[str, dict[str, int]] = {}
    for setting, option in SETTINGS.items():
        value = getattr(args, setting)
        if value is None:
            continue
        taking = [name for name in args.strategies if option in strategy_class(name).options]
        if not taking:
            flag = "--" + setting.replace("_", "-")
            owners = [name for name in vocabulary.available_strategies() if option in strategy_class(name).options]
            raise ValueError(
                f"{flag}: an option of strategy {', '.join(owners)}, which the planned strategies "
                f"({','.join(args.strategies)}) leave out; add it to --strategies or leave {flag} out"
            )
        for name in taking:
            options.setdefault(name, {})[option] = value
    return options


def check_compression(args: argparse.Namespace, strategy_options: dict[str, dict[str, int]]) -> None:
    """--compress that no planned strategy takes: one line naming those that do."""
    compression = parse_compression(args.compress)
    if not compression.compresses:
        return
    if compression_takers(compression, args.strategies, strategy_options):
        return
    owners = compression_takers(compression, vocabulary.available_strategies())
    raise ValueError(
        f"--compress: {args.compress} is taken by none of the planned strategies ({','.join(args.strategies)}); "
        f"{compression.kind} goes with {', '.join(owners)}: add one to --strategies, or leave --compress out"
    )


def measured_links(args: argparse.Namespace) -> tuple[list[str], tuple[str, dict[str, Any], Link] | None]:
    """(the dpkit bench files of --calibration, the dpkit doctor report with its path and measured link, if any),
    every file read and checked against the machine planned; a CUDA doctor's GPU stands for --gpu when none is
    named."""
    benches, doctors = calibration_files(args.calibration or [])
    if not doctors:
        return benches, None
    path, report = next(iter(doctors.items()))
    link = measured_link(report, path)
    args.gpu = check_measured_machine(report, args.gpu, bool(benches))
    return benches, (path, report, link)


def planned_machine(
    args: argparse.Namespace, catalogue: Catalogue, named: Hardware | None, benches: list[str]
) -> tuple[Hardware, CostConstants, str]:
    """The hardware and constants to plan on: the catalogue's (named), fitted to the bench files where given; with
    the line saying how well the fit matched."""
    if not benches:
        assert named is not None, "hardware_from_args asks for --gpu when there is no --calibration"
        return named, CostConstants(), ""
    from dpkit.plan.calibration import calibrate

    calibration = calibrate(benches, named)
    hardware, constants = calibration.for_hardware(named)
    calibrated = (
        f"calibrated on {', '.join(benches)}: fitted step times within {calibration.median_abs_error:.0%} (median "
        f"absolute error over {len(calibration.fit_errors)} configurations)"
    )
    if args.nodes > 1:
        hardware = replace(hardware, nodes=args.nodes, network=catalogue.network(args.network))
    return hardware, constants, calibrated


def run(args: argparse.Namespace) -> int:
    # every flag checked before any work (measuring a factory, fitting a calibration)
    if args.strategy:  # one strategy: the table of it alone (and its one-device reference)
        args.strategies = [args.strategy]
    strategy_options = options_from_settings(args)
    check_compression(args, strategy_options)
    for name in ("json", "png"):
        check_output_file(getattr(args, name), name)
    benches, doctor = measured_links(args)
    catalogue = Catalogue.load(args.catalogue)
    named_hardware, link_note = hardware_from_args(args, catalogue)
    batch = batch_from_args(args)
    profile = load_profile(args)
    hardware, constants, calibrated = planned_machine(args, catalogue, named_hardware, benches)
    measured = ""
    if doctor is not None:
        path, report, link = doctor
        measured = measured_words(path, hardware, report, link)
        hardware, link_note = with_measured_link(hardware, report, link), ""
    plan = make_plan(
        profile,
        hardware,
        args.strategies,
        args.device_counts,
        batch,
        args.precision,
        constants,
        args.optimizer,
        links=catalogue.links if not hardware.shared_compute and doctor is None else None,
        networks=catalogue.networks,
        strategy_options=strategy_options,
        compression=args.compress,
        accumulate=args.accumulate,
    )
    plan.meta["link_assumed"] = bool(link_note.startswith(" (the usual"))
    plan.meta["link_measured"] = doctor[0] if doctor is not None else None
    lines = wrap(
        f"dpkit plan: {profile.name}, {_parameters(profile.parameters)} parameters, "
        f"{_flops(profile.flops_per_sample)} forward per sample"
    )
    nodes = f"{hardware.nodes} nodes of " if hardware.nodes > 1 else ""
    network = f", network {hardware.network.name}" if hardware.nodes > 1 and hardware.network else ""
    lines += wrap(f"hardware: {nodes}{hardware.gpu.name}, link {hardware.link.name}{link_note}{network}")
    lines += wrap(
        f"batch {batch.describe()}, precision {args.precision}, optimizer {args.optimizer}"
        + (f", {args.accumulate} micro-batches per step" if args.accumulate > 1 else "")
        + (f", gradients compressed: {args.compress}" if args.compress != "none" else "")
    )
    for line in (calibrated, measured):
        if line:
            lines += wrap(line)
    print("\n".join(lines) + "\n")
    print(plan.format_table())
    if args.json:
        print(f"wrote {plan.save_json(args.json)}")
    if args.png:
        print(f"wrote {plan.save_png(args.png)}")
    return 0
