"""What a recipe run is (`TrainConfig`, plain values), every setting checked before any work starts, and where
the run runs (its Placement: strategy, devices, processes), resolved in one function.

A global batch given per device (batch_size_per_device) is turned into the global batch here, and every error
about the batch then names the argument the caller gave, with the per-device figure it gave.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dpkit.checks import check_batch_split, check_int, check_last_batch, check_number, check_output_folder, check_seed
from dpkit.compilation import check_compile, check_cpp_compiler
from dpkit.devices import DeviceLike, check_process_count
from dpkit.engine.placement import Placement, resolve_placement
from dpkit.errors import DpkitError
from dpkit.launch import Command
from dpkit.launch.environment import launched
from dpkit.precision import PRECISIONS, Precision
from dpkit.recipe.metrics_log import tensorboard_writer_class
from dpkit.recipe.optimization import OPTIMIZERS, SCHEDULES
from dpkit.strategies import available_strategies, checked_compression, strategy_class
from dpkit.strategies.compression import parse_compression
from dpkit.strategies.mesh import mesh_shape

# settings a resumed run must share with the run it continues
RESUME_MUST_MATCH = (
    "example",
    "model",
    "data",
    "seed",
    "batch_size",
    "accumulate",
    "optimizer",
    "momentum",
    "weight_decay",
)
# settings a resumed run may change when it says so (change=...), recorded in run.json; `steps` changes freely
# with a constant schedule and needs saying with a cosine one (it moves the curve)
CHANGEABLE = ("lr", "schedule", "lr_warmup_steps", "clip_grad_norm", "steps")
# settings that are one strategy option each: setting -> the option (a strategy without it refuses the setting)
STRATEGY_SETTINGS = {
    "zero_stage": "stage",
    "shard_size": "shard_size",
    "sync_every": "sync_every",
    "outer_lr": "outer_lr",
    "outer_momentum": "outer_momentum",
}
WHOLE_SETTINGS = ("zero_stage", "shard_size", "sync_every")  # counts; the others are rates
# what keep_best keeps the best model by: metric -> whether larger is better
BEST_BY = {"accuracy": True, "loss": False}
DIVERGED_EXIT_CODE = 3
BAD_INPUT_EXIT_CODE = 2


class TrainingDiverged(DpkitError):
    """The loss became nan or inf; training stopped before writing anything from it."""

    exit_code = DIVERGED_EXIT_CODE


@dataclass
class TrainConfig:
    """Everything a training run is, as plain values. `devices`: a count, a list ("cpu:0", 1, …) or "auto"."""

    example: str | None = "digits"  # the data and model; your `model` and `data` replace either
    model: str | None = None  # 'package.module:factory'
    data: str | None = None  # 'package.module:loader', loader(seed) -> x_train, y_train, x_test, y_test
    strategy: str = "single"
    accelerator: str = "auto"
    devices: int | str | Sequence[DeviceLike] = "auto"
    steps: int = 100  # optimizer steps in total, a resumed run's included
    batch_size: int = 64  # the global batch, split across devices
    batch_size_per_device: int | None = None  # instead of batch_size: the global batch is this times the devices
    seed: int = 0
    optimizer: str = "sgd"  # sgd, adamw or adam
    lr: float = 0.1  # the peak learning rate with a schedule
    momentum: float = 0.0  # sgd
    weight_decay: float = 0.0
    schedule: str = "constant"  # or "cosine": decays to 0 at the last step
    lr_warmup_steps: int = 0  # linear warm-up to lr over these first steps
    clip_grad_norm: float | None = None  # clip the gradients' global norm to this before each step
    precision: str = "32"
    accumulate: int = 1
    compile: bool | Mapping[str, Any] | None = (
        None  # True or torch.compile's options: the model's forward compiled (not a setting of the model)
    )
    find_unused_parameters: bool = False  # ddp, zero 1: steps may leave trainable parameters without a gradient
    static_graph: bool = False  # ddp: every step uses the same parameters
    compress: str = "none"  # gradient compression: none, bf16, fp16, powersgd or powersgd:R
    # PowerSGD's synchronized steps uncompressed first; None: 10% of steps (a resumed run keeps its state's)
    compress_warmup_steps: int | None = None
    zero_stage: int | None = None  # zero: 1 (optimizer state sharded) or 2 (gradients too); None: zero's default
    shard_size: int | None = None  # hsdp: processes per shard group (the rest replicate); None: one node's
    sync_every: int | None = None  # localsgd, diloco: optimizer steps between the replicas' meetings
    outer_lr: float | None = None  # diloco: the outer optimizer's learning rate (None: the paper's 0.7)
    outer_momentum: float | None = None  # diloco: its Nesterov momentum (None: the paper's 0.9)
    out: str = "runs/train"
    checkpoint_every: int | None = None
    sync_checkpoints: bool = False  # the saves every checkpoint_every steps hold the loop (default: background)
    keep: int = 2
    eval_every: int | None = None  # evaluate on the test data every K steps (and at the end)
    keep_best: str | None = None  # "accuracy" or "loss": keep OUT/best.pt, the best model by that evaluation metric
    log_every: int = 10  # write the steps' metrics to OUT/metrics.csv every K steps (rows per step)
    tensorboard: bool = False  # also write them to TensorBoard in OUT/tensorboard
    resume: bool = False
    resume_from: str | None = None  # a step directory of OUT/state to resume from (resumes; later states stay)
    change: (
        str | Sequence[str]
    ) = ()  # with resume: the settings of CHANGEABLE the resumed run changes, e.g. ("lr",) or "lr,schedule"
    overwrite: bool = False
    max_restarts: int = 0  # with processes started by `run` itself
    hang_timeout_seconds: float | None = None  # with processes started by `run` itself
    force: bool = False  # start more processes than a sane multiple of the cores
    progress: bool = True
    # how to run this same training again, once per device, where the strategy needs a process per device
    relaunch: Command | None = field(default=None, compare=False)
    resume_command: str | None = None  # what a person runs to resume this run (said after a stop)

    def settings(self) -> dict[str, Any]:
        """What run.json records: what decides the model a run ends with."""
        return {
            "example": None if (self.model and self.data) else self.example,
            "model": self.model,
            "data": self.data,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "accumulate": self.accumulate,
            "optimizer": self.optimizer,
            "lr": self.lr,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "schedule": self.schedule,
            "lr_warmup_steps": self.lr_warmup_steps,
            "clip_grad_norm": self.clip_grad_norm,
            "steps": self.steps,
        }

    def strategy_options(self) -> dict[str, Any]:
        """The strategy's options these settings ask for: find_unused_parameters where the strategy takes it (the
        single-process strategies need nothing), static_graph whenever asked (a strategy without it refuses it)."""
        options: dict[str, Any] = {}
        if self.find_unused_parameters and "find_unused_parameters" in strategy_class(self.strategy).options:
            options["find_unused_parameters"] = True
        if self.static_graph:
            options["static_graph"] = True
        for setting, option in STRATEGY_SETTINGS.items():
            if getattr(self, setting) is not None:
                options[option] = getattr(self, setting)
        if parse_compression(self.compress).compresses:
            options["compress"] = self.compress
            options["compress_warmup_steps"] = self.warmup_steps()
        return options

    def warmup_steps(self) -> int:
        """PowerSGD's warm-up: as given, else a tenth of the steps (torch's advice: start after about 10%)."""
        return self.compress_warmup_steps if self.compress_warmup_steps is not None else self.steps // 10

    def changes(self) -> tuple[str, ...]:
        """`change` as names: ("lr",) from "lr", ["lr"] or ("lr",)."""
        names = self.change.split(",") if isinstance(self.change, str) else list(self.change or ())
        return tuple(str(name).strip().replace("-", "_") for name in names if str(name).strip())

    def batch_given(self) -> str:
        """The batch as the caller gave it, for errors: `batch_size_per_device: 8 (a global batch of 16)` names
        the argument given, never the one derived from it."""
        if self.batch_size_per_device is None:
            return f"batch_size: {self.batch_size}"
        return f"batch_size_per_device: {self.batch_size_per_device} (a global batch of {self.batch_size})"


# --- where the run runs -------------------------------------------------------------------------------


def placement_of(config: TrainConfig) -> Placement:
    """The run's Placement: its strategy, devices and processes, the one place the recipe resolves them (a
    strategy on at most N devices takes N for devices="auto"). strategy="auto" before auto chose (resolve_auto):
    every device given, to choose among."""
    placement = resolve_placement(config.strategy, config.accelerator, config.devices, config.precision)
    if placement.undecided:
        return dataclasses.replace(placement, devices=placement.auto_devices, auto_devices=())
    return placement


def processes_of(placement: Placement) -> int:
    """Among how many the global batch is split: the launched processes, or the devices of this one (a strategy
    with a process per device, not launched yet, starts one per device)."""
    return placement.processes if placement.per_device and launched() else len(placement.devices)


def resolve_batch(config: TrainConfig) -> TrainConfig:
    """batch_size_per_device given: the config with its global batch (that many times the devices, or the
    launched processes), which is what the run records and checks; batch_size_per_device stays, for errors."""
    if config.batch_size_per_device is None:
        return config
    check_int(config.batch_size_per_device, "batch_size_per_device")
    count = processes_of(placement_of(config))
    return dataclasses.replace(config, batch_size=config.batch_size_per_device * count)


# --- checks, all before any work ----------------------------------------------------------------------


def describe_compression(config: TrainConfig) -> str:
    """', compress bf16' or ', compress powersgd:2 from step 10' for the start line; '' without compression."""
    compression = parse_compression(config.compress)
    if not compression.compresses:
        return ""
    after = f" from step {config.warmup_steps()}" if compression.kind == "powersgd" else ""
    return f", compress {compression}{after}"


def check_compression(config: TrainConfig) -> None:
    """compress: a value compression.py knows, a warm-up that is a count, and a strategy that takes it (the
    registry's one line otherwise); strategy "auto" chooses without compression."""
    compression = parse_compression(config.compress, config.compress_warmup_steps)
    if not compression.compresses:
        return
    if config.strategy == "auto":
        takers = [name for name in available_strategies() if len(strategy_class(name).traits.compressions) > 1]
        raise ValueError(
            f"compress: {str(compression)!r} goes with a strategy named for it ({', '.join(takers)}); "
            "strategy 'auto' chooses without compression"
        )
    checked_compression(config.strategy, config.strategy_options())


def check_strategy_settings(config: TrainConfig, processes: int) -> None:
    """zero_stage and shard_size only where the strategy has the option (asked of the registry), in its range; a
    shard group that divides the run's `processes`."""
    if all(getattr(config, setting) is None for setting in STRATEGY_SETTINGS):
        return
    for setting, option in STRATEGY_SETTINGS.items():
        value = getattr(config, setting)
        if value is None:
            continue
        taking = [name for name in available_strategies() if option in strategy_class(name).options]
        if config.strategy not in taking:
            raise ValueError(
                f"{setting}: strategy '{config.strategy}' has no {option.replace('_', ' ')}; "
                f"it is an option of strategy {', '.join(repr(name) for name in taking)} (or leave it out)"
            )
        if setting in WHOLE_SETTINGS:
            check_int(value, setting)
        elif setting == "outer_lr":
            check_number(value, setting, positive=True)
        else:
            check_number(value, setting)
            if value >= 1:
                raise ValueError(f"{setting}: expected a momentum in [0, 1), got {value!r}")
    strategy_class(config.strategy).traits_for(**config.strategy_options())  # each strategy's own range checks
    if config.shard_size is not None:
        mesh_shape(processes, config.shard_size)


def check_config(config: TrainConfig) -> list[torch.device]:
    """Every setting checked without building or measuring anything: the values, the packages they need
    (TensorBoard), the devices, the batch's split over them and the run folder's path; one line on the first bad
    value. The devices the run uses. strategy="auto" is checked as far as it can be before auto chooses."""
    for name in ("steps", "batch_size", "accumulate", "keep", "log_every"):
        check_int(getattr(config, name), name)
    for name in ("checkpoint_every", "eval_every"):
        if getattr(config, name) is not None:
            check_int(getattr(config, name), name)
    check_int(config.max_restarts, "max_restarts", minimum=0)
    if config.hang_timeout_seconds is not None:
        check_number(config.hang_timeout_seconds, "hang_timeout_seconds", positive=True)
    check_optimization(config)
    check_seed(config.seed)
    if config.precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {config.precision!r}")
    check_output_folder(config.out, "out")
    compile_options = check_compile(config.compile)
    if config.resume and config.overwrite:
        raise ValueError(
            "resume/overwrite: give one: resume=True continues the run in the folder, overwrite=True replaces it"
        )
    from dpkit.recipe.earlier_state import check_resume_from  # (it reads the folder's names from folder.py)

    check_resume_from(config)
    placement = placement_of(config)
    devices = list(placement.devices)
    check_cpp_compiler(compile_options, devices[0].type)
    check_strategy_settings(config, max(placement.processes, len(devices)))
    check_compression(config)
    if config.strategy == "auto":
        check_batch_split(config.batch_size, len(devices))
        Precision(config.precision, devices[0].type)
        return devices
    traits = strategy_class(config.strategy).traits_for(**config.strategy_options())  # (refuses an option it lacks)
    if traits.max_devices is not None and len(devices) > traits.max_devices:
        others = [name for name in available_strategies() if strategy_class(name).traits.max_devices is None]
        raise ValueError(
            f"devices: strategy '{config.strategy}' runs on {traits.max_devices} device(s), got {len(devices)}; "
            f"to train on {len(devices)} devices pass a strategy for several ({', '.join(others)}; "
            f"docs/strategies.md says which), or devices={traits.max_devices}"
        )
    Precision(config.precision, devices[0].type)  # what the devices cannot do, refused here, not in each process
    if strategy_class(config.strategy).needs_launcher():
        check_process_count(len(devices), argument="devices", force=config.force)
    check_batch_split(config.batch_size, processes_of(placement))
    return devices


def check_batch_against_data(config: TrainConfig, rows: int) -> None:
    """The batch against the training rows: no larger than them, and a last batch that gives every device (or
    process) a row; in the argument the caller gave (batch_size, or batch_size_per_device)."""
    processes = processes_of(placement_of(config))
    per_device = config.batch_size_per_device
    if config.batch_size > rows:
        if per_device is None:
            raise ValueError(
                f"batch_size: {config.batch_size} is larger than the {rows} training rows; use at most {rows}"
            )
        raise ValueError(
            f"{config.batch_given()} is larger than the {rows} training rows; use at most {rows // processes}"
        )
    if per_device is None:
        check_last_batch(config.batch_size, rows, processes)
        return
    last = rows % config.batch_size
    if processes < 2 or last == 0 or last >= processes:
        return

    def keeps(size: int) -> bool:
        global_batch = size * processes
        return global_batch <= rows and (rows % global_batch == 0 or rows % global_batch >= processes)

    sizes = [size for size in range(1, rows // processes + 1) if keeps(size)]
    near = min(sizes, key=lambda size: abs(size - per_device)) if sizes else None
    raise ValueError(
        f"{config.batch_given()} leaves a last batch of {last} row(s) of the {rows} training rows, fewer than the "
        f"{processes} devices, so a device would sit idle in that step; give a batch per device that leaves at "
        f"least {processes}" + (f", such as {near}" if near else "") + ", or fewer devices"
    )


def check_optimization(config: TrainConfig) -> None:
    """The optimizer, schedule, clipping, evaluation and metrics settings, each refused in one line."""
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, got {config.optimizer!r}")
    if config.schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {config.schedule!r}")
    check_number(config.lr, "lr", positive=True)
    check_number(config.momentum, "momentum")
    check_number(config.weight_decay, "weight_decay")
    if config.momentum and config.optimizer != "sgd":
        raise ValueError(
            f"momentum: applies to optimizer=sgd, got momentum={config.momentum:g} with optimizer={config.optimizer} "
            "(adam and adamw have their own betas); leave momentum at 0"
        )
    check_int(config.lr_warmup_steps, "lr_warmup_steps", minimum=0)
    if config.lr_warmup_steps > config.steps:
        raise ValueError(
            f"lr_warmup_steps: {config.lr_warmup_steps} is more than the run's {config.steps} steps; use at most "
            f"{config.steps}"
        )
    if config.clip_grad_norm is not None:
        check_number(config.clip_grad_norm, "clip_grad_norm", positive=True)
    if config.batch_size_per_device is not None:
        check_int(config.batch_size_per_device, "batch_size_per_device")
    if config.keep_best is not None:
        if config.keep_best not in BEST_BY:
            raise ValueError(f"keep_best: expected one of {', '.join(BEST_BY)}, got {config.keep_best!r}")
        if config.eval_every is None:
            raise ValueError(
                f"keep_best: the best model by {config.keep_best} needs evaluations; add eval_every=K (steps)"
            )
    changing = config.changes()
    unknown = [name for name in changing if name not in CHANGEABLE]
    if unknown:
        raise ValueError(
            f"change: {', '.join(unknown)} cannot change mid-run; a resumed run may change {', '.join(CHANGEABLE)}"
        )
    if changing and not config.resume:
        raise ValueError(f"change: goes with resume=True (a new run has nothing to change), got change={changing[0]}")
    if config.tensorboard:
        tensorboard_writer_class()  # installed, or one line saying how to get it
