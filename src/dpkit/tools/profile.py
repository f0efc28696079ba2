"""Profile a few steps of a model under any strategy, through the Engine: per device peak memory by
category, time by phase, and the imbalance (max/mean of per-device peaks). `dpkit profile` runs this.

    report, last_loss = profile(ProfileSpec(example="wide-output", strategy="dp", accelerator="cpu", devices=4))
    print(report.format_table())

`run(spec)` also prints the table and writes the JSON report (spec.json), a stacked bar chart of memory
by category per device (spec.png) and a Chrome trace of the phases on each device's track (spec.trace), with
the collectives each rank issued in the observed steps (ddp, fsdp) on its device's track.
With a strategy that runs one process per device, every process measures itself and rank 0 writes one
report holding every rank's devices; without a launcher, `run` starts the processes itself
(spec.relaunch says how to run this same profile in each).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from dpkit.checks import check_batch_split, check_int, check_output_file
from dpkit.compilation import CompileCounts, check_compile, compile_counts, describe_compile
from dpkit.devices import resolve_devices
from dpkit.engine.engine import Engine
from dpkit.examples import wide_output
from dpkit.launch import Command, launched, relaunch
from dpkit.launch.environment import process_place
from dpkit.observe import Observer, Report, active
from dpkit.observe.collectives import PROFILE_RING_SIZE, RECORD
from dpkit.observe.measured_balance import balance_notes
from dpkit.observe.memory import is_dtensor
from dpkit.observe.report import collective_spans
from dpkit.parallel.balance import CALIBRATION_CALLS
from dpkit.precision import PRECISIONS as ENGINE_PRECISIONS
from dpkit.recipe.config import TrainConfig
from dpkit.recipe.optimization import build_optimizer
from dpkit.recipe.sources import criterion_for, model_source
from dpkit.strategies import checked_compression, strategy_class
from dpkit.strategies.compression import parse_compression

# the Engine's precisions, and "64": the model and data in float64 (for comparisons exact to rounding)
PRECISIONS = (*ENGINE_PRECISIONS, "64")
OPTIMIZERS = ("adam", "adamw", "sgd")

# The global batch when none is given: `dpkit train`'s, except for an example whose lesson needs rows on every
# device (this many per device; wide-output: dp-balanced evens its peaks out only from ~45 rows per device).
DEFAULT_BATCH_SIZE = TrainConfig.batch_size
EXAMPLE_ROWS_PER_DEVICE = {"wide-output": wide_output.PROFILE_ROWS_PER_DEVICE}


@dataclass
class ProfileSpec:
    """What to profile: the model and data (an example, or your 'package.module:factory' and loader), the
    strategy and devices, and the steps: `warmup` unobserved ones first, then `steps` observed ones."""

    example: str | None = "wide-output"
    model: str | None = None
    data: str | None = None
    input_shape: tuple[int, ...] | None = None  # with your model and no data: synthetic rows of this shape
    strategy: str = "dp"
    accelerator: str = "auto"
    devices: Any = "auto"
    steps: int = 3
    warmup: int = 3
    batch_size: int | None = None  # the global batch; None: DEFAULT_BATCH_SIZE, or the example's rows per device
    batch_size_per_device: int | None = None  # instead: the global batch is this times the devices
    lr: float = 1e-3
    optimizer: str = "adam"
    precision: str = "32"
    seed: int = 0
    # torch.compile the model's forward: True, a backend's name or torch.compile's options (the Engine's compile=)
    compile: bool | str | dict[str, Any] | None = None
    # gradient compression (the Engine's compress=); PowerSGD compresses from the first observed step
    compress: str = "none"
    json: str | None = None
    png: str | None = None
    trace: str | None = None
    progress: bool = True
    # how to run this same profile again, once per device, where the strategy needs a process per device
    relaunch: Command | None = field(default=None, compare=False)

    def check(self) -> None:
        for name in ("json", "png", "trace"):  # a folder or an unwritable place is found now, not after profiling
            check_output_file(getattr(self, name), name)
        strategy_class(self.strategy)
        check_int(self.steps, "steps")
        check_int(self.warmup, "warmup", minimum=0)
        if self.batch_size is not None:
            check_int(self.batch_size, "batch_size")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if str(self.precision) not in PRECISIONS:
            raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        check_compile(compile_options(self.compile))
        if parse_compression(self.compress).compresses:
            checked_compression(self.strategy, {"compress": self.compress})
        if self.batch_size_per_device is not None:
            check_int(self.batch_size_per_device, "batch_size_per_device")
        calibration = CALIBRATION_CALLS["memory"]
        if strategy_class(self.strategy).traits.balances and self.warmup < calibration:
            logging.getLogger("dpkit").warning(
                "warmup %d: strategy %s calibrates during its first %d steps, so the observed steps include unbalanced "
                "ones; use a warm-up of %d or more",
                self.warmup,
                self.strategy,
                calibration,
                calibration,
            )


def batches_forever(loader: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def global_batch_size(spec: ProfileSpec, devices: int) -> int:
    """The global batch on `devices` devices (or on the launched processes): batch_size, batch_size_per_device
    times the devices, or with neither the default (EXAMPLE_ROWS_PER_DEVICE's example: its rows per device)."""
    per_device = spec.batch_size_per_device
    if per_device is None and spec.batch_size is None and spec.model is None and spec.example is not None:
        per_device = EXAMPLE_ROWS_PER_DEVICE.get(spec.example)
    if per_device is None:
        return spec.batch_size if spec.batch_size is not None else DEFAULT_BATCH_SIZE
    return per_device * (process_place().world_size if launched() else devices)


def _rows(spec: ProfileSpec) -> int:
    """The global batch of a spec profile() resolved (global_batch_size)."""
    if spec.batch_size is None:
        raise RuntimeError("profile: the spec's global batch is resolved first (global_batch_size)")
    return spec.batch_size


def checked_devices(spec: ProfileSpec) -> list[torch.device]:
    """Every setting checked before anything is built or started (spec.check(), the strategy's device count, the
    batch's split over the devices); the devices the profile runs on."""
    spec.check()
    cls = strategy_class(spec.strategy)
    devices = resolve_devices(spec.accelerator, spec.devices)
    if cls.traits.max_devices is not None and len(devices) > cls.traits.max_devices:
        if spec.devices != "auto":
            raise ValueError(
                f"devices: strategy '{spec.strategy}' runs on {cls.traits.max_devices} device(s), got {len(devices)}; "
                f"pass devices={cls.traits.max_devices}, or a strategy for several devices (strategy=dp, ddp, …)"
            )
        devices = devices[: cls.traits.max_devices]
    check_batch_split(global_batch_size(spec, len(devices)), len(devices))
    return devices


def profile(spec: ProfileSpec) -> tuple[Report | None, float]:
    """Run warm-up and observed steps through the Engine; the report of the observed ones (every rank's
    devices when there is a process per device; None on the ranks other than 0) and the last loss (the
    global batch's)."""
    cls = strategy_class(spec.strategy)
    devices = checked_devices(spec)
    spec = replace(spec, batch_size=global_batch_size(spec, len(devices)), batch_size_per_device=None)
    model, x, y = _model_and_data(spec)
    whole_gradient_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    momentum = 0.9 if spec.optimizer == "sgd" else 0.0
    optimizer = build_optimizer(spec.optimizer, model.parameters(), spec.lr, momentum, weight_decay=0.0)
    # the layout a strategy has on GPUs, also on virtual CPU devices (replicated would share one copy there)
    engine = Engine(
        strategy=spec.strategy,
        accelerator=devices[0].type,
        devices=devices,
        precision="32" if str(spec.precision) == "64" else str(spec.precision),
        progress=spec.progress,
        compile=compile_options(spec.compile),
        compress=spec.compress,
        compress_warmup_steps=spec.warmup if parse_compression(spec.compress).compresses else None,
        **cls.profile_options(),
    )
    before_warm_up = compile_counts()
    try:
        step, wrapped = _training_step(engine, model, optimizer, x, y, spec)
        here, last_loss, compiled = _observed_steps(engine, spec, step, optimizer, before_warm_up)
        # where memory balance cannot even the peaks out at this batch: why, and the batch that lets it
        notes = balance_notes(wrapped, _rows(spec))
        kept = engine.gather_object(kept_bytes(engine.model_copies()[0][0], optimizer)) if cls.traits.sharded else None
        reports = engine.gather_object(here)
        writes = engine.is_global_zero
    finally:
        engine.close()
    if not writes:
        return None, last_loss
    report = _merged_report(spec, devices, reports, last_loss, compiled, kept, whole_gradient_bytes)
    if notes:
        report.meta["balance_note"] = " ".join(notes)
    return report, last_loss


def _model_and_data(spec: ProfileSpec) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model built from the seed, and the data's inputs and targets, in float64 for precision "64"."""
    source = model_source(
        spec.example, spec.model, spec.data, input_shape=spec.input_shape, synthetic_rows=max(256, _rows(spec))
    )
    torch.manual_seed(spec.seed)
    model = source.build_model()
    x, y = source.load_data(spec.seed)[:2]
    if len(x) < _rows(spec):
        raise ValueError(f"batch_size: {_rows(spec)} rows but the data has only {len(x)}; use a smaller batch")
    dtype = torch.float64 if str(spec.precision) == "64" else torch.float32
    model = model.to(dtype=dtype)
    x = x.to(dtype) if x.is_floating_point() else x
    y = y.to(dtype) if y.is_floating_point() else y
    return model, x, y


def _training_step(
    engine: Engine,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    spec: ProfileSpec,
) -> tuple[Callable[[], float], torch.nn.Module]:
    """The model, optimizer, criterion and loader set up through the engine: one training step on the next
    batch, returning the global batch's loss, and the set-up model."""
    model, engine_optimizer = engine.setup(model, optimizer)
    criterion = engine.setup_criterion(criterion_for(y))
    sampler = RandomSampler(range(len(x)), generator=torch.Generator().manual_seed(spec.seed))
    loader = engine.setup_dataloader(
        DataLoader(TensorDataset(x, y), batch_size=_rows(spec), sampler=sampler, drop_last=True)
    )
    batches = batches_forever(loader)

    def step() -> float:
        xb, yb = next(batches)
        engine_optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(xb), yb)
        engine.backward(loss)
        engine_optimizer.step()  # timed and charged by the observer's optimizer hooks
        return float(engine.reduce(loss.detach(), "mean", weight=len(yb)))

    return step, model


def _observed_steps(
    engine: Engine,
    spec: ProfileSpec,
    step: Callable[[], float],
    optimizer: torch.optim.Optimizer,
    before_warm_up: CompileCounts,
) -> tuple[Report, float, dict[str, Any] | None]:
    """The warm-up steps, then the observed ones: (this process's report, the last loss, what compiling cost)."""
    with engine.progress(total=spec.warmup + spec.steps, desc=f"profile {spec.strategy}", unit="step") as bar:
        for _ in range(spec.warmup):
            step()
            bar.update()
        after_warm_up = compile_counts()
        # every collective of the observed steps is kept for the trace, not only the ring's last RING_SIZE
        gradient_bytes_before = RECORD.gradient_bytes
        with RECORD.keeping(PROFILE_RING_SIZE) as before:
            with Observer(engine.device, models=engine.model_copies(), optimizers=[optimizer]) as observer:
                for _ in range(spec.steps):
                    last_loss = step()
                    bar.update()
            issued, dropped = RECORD.since(before), RECORD.sequence - before
        gradient_bytes = (RECORD.gradient_bytes - gradient_bytes_before) / spec.steps
        here = observer.report()
        here.meta["gradient_bytes_per_step"] = gradient_bytes
        here.collectives = collective_spans(issued, observer.home or str(engine.device), observer.clock.origin)
        dropped -= len(issued)  # beyond PROFILE_RING_SIZE: the first ones are not in the trace
        # the step's split between the calling thread and the replica threads, timed again without memory
        # accounting, which would distort it (observe/step_split.py); not while another observer still runs
        # (dp-balanced calibrating past a short warm-up), whose stop must find its own dispatch mode on top
        if not active():
            with Observer(engine.device, memory=False, trace=False, backward_by_device=False) as timer:
                for _ in range(spec.steps):
                    last_loss = step()
            here.threads = timer.report().threads
        compiled = None
        if engine.compile_options is not None:  # the warm-up's compiles, and any recompile in the steps after
            compiled = {
                "options": describe_compile(engine.compile_options),
                "warm_up": after_warm_up.since(before_warm_up).as_dict(),
                "recompiles_after_warm_up": compile_counts().since(after_warm_up).frames,
            }
    if dropped > 0:
        here.meta["collectives_not_kept"] = dropped
    return here, last_loss, compiled


def _merged_report(
    spec: ProfileSpec,
    devices: list[torch.device],
    reports: list[Report],
    last_loss: float,
    compiled: dict[str, Any] | None,
    kept: list[Any] | None,
    gradient_bytes_uncompressed: int = 0,
) -> Report:
    """Every process's report as one (on rank 0), with what was profiled and how in its meta."""
    report = Report.merged(reports) if len(reports) > 1 else reports[0]
    report.meta = {
        "example": None if spec.model else spec.example,
        "model": spec.model,
        "strategy": spec.strategy,
        "devices_requested": [str(d) for d in devices],
        "processes": len(reports),
        "batch_size": _rows(spec),
        "precision": str(spec.precision),
        "optimizer": spec.optimizer,
        "warmup_steps": spec.warmup,
        "seed": spec.seed,
        "last_loss": last_loss,
        "compress": str(parse_compression(spec.compress)),
        # the bytes of gradient exchange this process (rank 0) issued per observed step, from the collective
        # record (replicated: what would cross between its devices); and what the whole gradient is in float32
        "gradient_bytes_per_step": reports[0].meta.get("gradient_bytes_per_step", 0.0),
        "gradient_bytes_uncompressed": gradient_bytes_uncompressed,
    }
    if compiled is not None:
        report.meta["compile"] = compiled
    if kept is not None:
        report.meta["kept_bytes"] = kept  # per rank
    not_kept = [r.meta.get("collectives_not_kept", 0) for r in reports]
    if any(not_kept):  # the first collectives of a very long profile (per rank), missing from the trace
        report.meta["collectives_not_kept"] = not_kept
    return report


def kept_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
    """What this device keeps between steps of the parameters, their gradients and the optimizer's state
    ("held": a sharded strategy's shards, each storage once), and what it would keep if nothing were sharded
    ("unsharded", as under ddp: the whole sizes; a DTensor's numel is the whole one)."""
    parameters: list[torch.Tensor] = list(model.parameters())
    tensors: dict[str, list[torch.Tensor]] = {
        "parameters": parameters,
        "gradients": [p.grad for p in parameters if p.grad is not None],
        "optimizer_state": [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)],
    }

    def held(group: list[torch.Tensor]) -> int:
        storages: dict[int, int] = {}
        for tensor in group:
            storage = (tensor.to_local() if is_dtensor(tensor) else tensor).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    return {
        "held": {name: held(group) for name, group in tensors.items()},
        "unsharded": {name: sum(t.numel() * t.element_size() for t in group) for name, group in tensors.items()},
    }


def sharding_line(report: Report) -> str | None:
    """Beside a sharded strategy's table: what each device keeps between steps against the whole sizes every
    device keeps when nothing is sharded."""
    kept = report.meta.get("kept_bytes")
    if not kept:
        return None
    mib = 1024 * 1024
    held = max(sum(rank["held"].values()) for rank in kept)
    whole = kept[0]["unsharded"]
    total = sum(whole.values())
    return (
        f"kept between steps (params + grads + optim): at most {held / mib:.2f} MiB per device; unsharded, as "
        f"under ddp (before its gradient buckets), every device keeps {whole['parameters'] / mib:.2f} + "
        f"{whole['gradients'] / mib:.2f} + {whole['optimizer_state'] / mib:.2f} = {total / mib:.2f} MiB "
        f"({held / total:.2f}x)"
    )


def gradient_bytes_line(report: Report) -> str | None:
    """How many bytes of gradient crossed per step, and the compression's ratio against the float32 gradient."""
    sent, whole = report.meta.get("gradient_bytes_per_step") or 0, report.meta.get("gradient_bytes_uncompressed") or 0
    if not sent or not whole:
        return None
    compress = report.meta.get("compress", "none")
    ratio = f"{whole / sent:.1f}x fewer than" if compress != "none" else f"{sent / whole:.2f}x"
    return (
        f"gradient exchange: {sent / 2**20:.2f} MiB per step from this process ({compress}; {ratio} the float32 "
        f"gradient's {whole / 2**20:.2f} MiB)"
    )


def compile_options(value: bool | str | Mapping[str, Any] | None) -> bool | Mapping[str, Any] | None:
    """ProfileSpec.compile as the Engine's compile=: a backend's name (`dpkit profile --compile aot_eager`) as
    {"backend": name}."""
    return {"backend": value} if isinstance(value, str) else value


def compile_line(compiled: Mapping[str, Any], warmup: int) -> str:
    """What compiling cost: graphs, graph breaks and their first reasons, seconds, recompiles after the warm-up."""
    warm = compiled["warm_up"]
    reasons = list(warm["break_reasons"].items())[:3]
    breaks = f"{warm['graph_breaks']} graph break(s)" + (
        " (" + "; ".join(f"{count}x {reason}" for reason, count in reasons) + ")" if reasons else ""
    )
    line = (
        f"compile: {warm['graphs']} graph(s), {breaks}, {warm['compile_seconds']:.1f} s compiling in the "
        f"{warmup} warm-up step(s) (not in the medians); {compiled['recompiles_after_warm_up']} recompile(s) after"
    )
    if warmup == 0:
        line += "; with no warm-up the first observed step includes the compile (pass warmup of 1 or more)"
    return line


def run(spec: ProfileSpec) -> Report | None:
    """Profile, print the table and write the files asked for; starts one process per device first where the
    strategy needs it (the report is then printed and written by their rank 0, and None returned here)."""
    if strategy_class(spec.strategy).needs_launcher():
        devices = checked_devices(spec)
        if spec.relaunch is None:
            raise RuntimeError(
                f"strategy: '{spec.strategy}' runs one process per device; give the spec a relaunch= that "
                "runs this profile again in each, or use `dpkit profile`"
            )
        relaunch(spec.relaunch, len(devices))
        return None
    report, last_loss = profile(spec)
    if report is None:  # a rank other than 0: rank 0 writes every rank's devices
        return None
    on_devices = ", ".join(d.device for d in report.devices)
    print(
        f"dpkit profile: {report.meta['model'] or spec.example}, strategy {spec.strategy}, "
        f"batch {report.meta['batch_size']}, "
        f"precision {spec.precision}, {spec.steps} observed step(s) after {spec.warmup} warm-up, on {on_devices}"
    )
    print(report.format_table())
    line = sharding_line(report)
    if line:
        print(line)
    compiled = report.meta.get("compile")
    if compiled is not None:
        print(compile_line(compiled, spec.warmup))
    line = gradient_bytes_line(report)
    if line:
        print(line)
    print(f"last loss: {last_loss:.6f}")
    if spec.json:
        print(f"wrote {report.save_json(spec.json)}")
    if spec.png:
        print(f"wrote {report.save_png(spec.png, title=f'{spec.strategy}: memory by category at each device peak')}")
    if spec.trace:
        print(f"wrote {report.save_trace(spec.trace)}")
    return report
