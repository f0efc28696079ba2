"""`dpkit plan`: predict step time, throughput, scaling and memory per strategy and device count, and
recommend one, before running anything.

    dpkit plan --model gpt2-124m --gpu h100-sxm --link nvlink4 --devices 1,2,4,8 --batch-size-per-device 8 \\
               --precision bf16-mixed --json plan.json --png plan.png
    dpkit plan --model mypkg.models:build --input-shape 3,224,224 --gpu a100-80gb-sxm --link pcie4 ...
    dpkit plan --params 125e6 --flops-per-sample 2.5e11 --gpu h100-sxm --link pcie4 ...
    dpkit plan --model mypkg.models:build --input-shape 64 --calibration bench.json   # this machine, fitted

The formulas and their sources are in docs/cost-model.md. When nothing fits, the recommendation names no
strategy (printed as "recommendation: none", JSON "strategy": null) and its reasons, with "would_fit" in the
JSON, say what would: the device count on which the sharded strategy fits, CPU offload, a smaller batch.
"""

from __future__ import annotations

import argparse

from dpkit.cli.flags import comma_ints
from dpkit.plan.calibration import calibrate
from dpkit.plan.catalogue import Catalogue
from dpkit.plan.cost_model import CostConstants, Hardware
from dpkit.plan.planner import make_plan
from dpkit.plan.profiles import BUILTIN_PROFILES, ModelProfile, builtin_profile, given_profile, measure_model
from dpkit.strategies import available_strategies, strategy_class

# library arguments this command spells differently
SPELLED = {"batch_per_device": "--batch-size-per-device", "strategy": "--strategies"}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("plan", help="predict step time, scaling and memory per strategy; recommend one")
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model", help=f"a built-in profile ({', '.join(BUILTIN_PROFILES)}) or 'package.module:factory'"
    )
    model.add_argument(
        "--input-shape", help="per-sample input shape, e.g. 3,224,224 (a factory needs it; scales a CNN profile)"
    )
    model.add_argument("--seq-len", type=int, help="sequence length for a transformer profile")
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
    hardware.add_argument("--gpu", help="a GPU of the catalogue, e.g. h100-sxm (not needed with a CPU --calibration)")
    hardware.add_argument("--link", help="the link between the GPUs of a node, e.g. nvlink4, pcie4")
    hardware.add_argument("--nodes", type=int, default=1, help="nodes (ddp only spans nodes; default 1)")
    hardware.add_argument("--network", help="the network between nodes, e.g. ib-200g (with --nodes > 1)")
    hardware.add_argument("--catalogue", help="a JSON/TOML file adding to or overriding the hardware catalogue")
    parser.add_argument(
        "--devices", default="1,2,4,8", help="devices per node to predict, comma-separated (default: 1,2,4,8)"
    )
    parser.add_argument("--batch-size-per-device", type=int, required=True, help="samples per device per step")
    parser.add_argument("--precision", default="32", choices=["32", "tf32", "bf16-mixed", "16-mixed"])
    parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    parser.add_argument(
        "--strategies", default=",".join(available_strategies()), help="comma-separated (default: every strategy)"
    )
    parser.add_argument("--calibration", help="a dpkit bench JSON to fit the compute and overhead constants to")
    parser.add_argument("--json", help="write the plan as JSON here")
    parser.add_argument("--png", help="write throughput and step-breakdown plots here")
    return parser


def load_profile(args: argparse.Namespace) -> ModelProfile:
    if args.model and args.params is not None:
        raise ValueError("--model/--params: give a model or its numbers, not both")
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
        raise ValueError("--model: give a built-in profile, 'package.module:factory', or the numbers with --params")
    shape = tuple(comma_ints("--input-shape", args.input_shape)) if args.input_shape else None
    if ":" in args.model:
        from dpkit.examples import load_factory

        if shape is None:
            raise ValueError(
                f"--input-shape: the factory {args.model!r} needs the per-sample input shape, "
                "e.g. --input-shape 3,224,224"
            )
        return measure_model(load_factory(args.model), shape, name=args.model)
    return builtin_profile(args.model, shape, args.seq_len)


def run(args: argparse.Namespace) -> int:
    profile = load_profile(args)
    catalogue = Catalogue.load(args.catalogue)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for name in strategies:
        strategy_class(name, argument="--strategies")  # raises on an unknown name, listing the registry's strategies
    devices = comma_ints("--devices", args.devices)
    if args.nodes < 1:
        raise ValueError(f"--nodes: expected at least 1, got {args.nodes}")
    if args.nodes > 1 and not args.network:
        raise ValueError("--network: --nodes > 1 needs the network between nodes, e.g. --network ib-200g")
    hardware = None
    if args.gpu or args.link or not args.calibration:
        if not args.gpu or not args.link:
            raise ValueError(
                "--gpu/--link: name both (e.g. --gpu h100-sxm --link nvlink4), "
                "or plan for this machine with --calibration bench.json"
            )
        hardware = Hardware(
            catalogue.gpu(args.gpu),
            catalogue.link(args.link),
            catalogue.network(args.network) if args.network else None,
            args.nodes,
        )
    constants = CostConstants()
    if args.calibration:
        calibration = calibrate(args.calibration, hardware)
        hardware, constants = calibration.for_hardware(hardware)
        print(
            f"calibrated on {args.calibration}: fitted step times within {calibration.median_abs_error:.0%} "
            f"(median absolute error over {len(calibration.fit_errors)} configurations)"
        )
        if args.nodes > 1:
            from dataclasses import replace

            hardware = replace(hardware, nodes=args.nodes, network=catalogue.network(args.network))
    plan = make_plan(
        profile,
        hardware,
        strategies,
        devices,
        args.batch_size_per_device,
        args.precision,
        constants,
        args.optimizer,
        links=catalogue.links if not hardware.shared_compute else None,
        networks=catalogue.networks,
    )
    print(
        f"dpkit plan: {profile.name} ({profile.parameters / 1e6:,.1f}M parameters, "
        f"{profile.flops_per_sample / 1e9:,.3g} GFLOP "
        f"forward per sample) on {hardware.gpu.name}, link {hardware.link.name}"
        + (f", {hardware.nodes} nodes over {hardware.network.name}" if hardware.nodes > 1 else "")
        + f"; batch {args.batch_size_per_device} per device, precision {args.precision}"
    )
    print(plan.format_table())
    if args.json:
        print(f"wrote {plan.save_json(args.json)}")
    if args.png:
        print(f"wrote {plan.save_png(args.png)}")
    return 0
