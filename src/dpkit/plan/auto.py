"""`strategy="auto"`: which strategy to train with on the devices given, and why, in one line.

    choice = choose_strategy(model, sample_batch, batch_size=32, devices=["cpu:0", "cpu:1"])
    print(choice.reason)   # auto: single — on this model a step is mostly operation launches (…); …
    choice.strategy, choice.devices, choice.candidates

Every strategy of the registry is a candidate: the reference on one device with the whole batch, the others on
every device given with the batch split across them. Each candidate gets a step time (the cost model's
prediction, or a measured one the caller passes in `step_seconds`) and its peak memory, and the rules below
choose, in this order:

1. One device: the reference strategy (single).
2. Never a strategy that does not fit in memory (the fullest device's peak within 90% of a GPU's memory; on
   virtual CPU devices, which share the host's memory, the devices' peaks together within 90% of it) or that
   cannot run at the precision asked (16-mixed needs a GradScaler).
3. A strategy with a process per device (ddp, fsdp) only when `can_launch` (the caller can start or has
   started the processes; on virtual CPU devices, at most 4 processes per core).
4. The lightest sharding that fits (Traits: fewer parts of the state sharded, then a shard group of one node before
   every process; unsharded first): a more sharded strategy only when it is predicted at least 10% faster than
   every lighter one that fits (ddp before zero, zero before fsdp), or when nothing lighter fits.
5. Several devices only when they pay: the fastest multi-device candidate must take at most 1/1.1 of the
   reference's step for the same global batch (10% faster); otherwise the reference, with the reason (a step
   that is mostly operation launches, or what the others lose to communication and per-step work).
6. Among multi-device candidates within 10% of the fastest ("equals"): on GPUs one with a process per device
   (ddp), as PyTorch recommends over DataParallel, the least sharded of them, then the fastest; on virtual CPU
   devices the fastest one-process strategy (no processes to start, and the processes' edge on a GPU, no GIL, is
   small on shared cores).
7. When nothing fits: a ValueError naming what was tried and what would fit.

Where the step times come from:
- GPUs: the catalogue's figures for the GPU torch reports (its usual link), or `hardware=`; `calibration=` (a
  GPU bench's Calibration or bench JSONs) fits the host's constants.
- virtual CPU devices: `calibration=` (a Calibration, or `dpkit bench --json` files of this machine), else a probe
  of this machine on two small fixed models (plan/probe.py: about a second, once per process).
- `step_seconds={"single": 0.004, "dp": 0.009, ...}`: measured (or injected) step times of the same global
  batch, which replace the predictions for those strategies (tests use it to fix the numbers).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

import torch
from torch import nn

from dpkit.devices import PROCESSES_PER_CORE, DeviceLike, available_cores, parse_device
from dpkit.plan.advisor import LAUNCH_BOUND_SHARE, is_data_parallel, lightest_worthwhile, phase_words
from dpkit.plan.calibration import Calibration, calibrate
from dpkit.plan.catalogue import GPU, Catalogue
from dpkit.plan.cost_model import (
    OPTIMIZER_STATE_BYTES_PER_PARAMETER,
    BatchSize,
    CostConstants,
    Hardware,
    Prediction,
    Setup,
    lightest_sharding,
    memory_per_device,
    predict_setup,
    runs_at,
)
from dpkit.plan.profiles import ModelProfile, measure_model
from dpkit.strategies import ONE_PROCESS, PER_DEVICE, Traits, available_strategies, reference, strategy_class

PAYS = 1.1  # several devices must be this much faster than one (rule 5)
EQUALS = 1.1  # candidates within this factor of the fastest are equals (rule 6)
USABLE_SHARE = 0.9  # of a GPU's memory, or of the host's for virtual CPU devices together
STATED_PHASES = ("scatter", "replicate", "gather", "reduce", "all_reduce", "all_gather", "reduce_scatter")
# what calibration= takes: a fitted Calibration, or the `dpkit bench --json` file(s) to fit one to
CalibrationSource: TypeAlias = Calibration | str | os.PathLike | Sequence[str | os.PathLike]


@dataclass
class Candidate:
    """One strategy on its devices: its step for the global batch, its memory, and whether the rules allow it."""

    strategy: str
    devices: int
    step_seconds: float
    source: str  # "predicted" or "measured"
    peak_bytes: int  # the fullest device's predicted peak (virtual CPU devices: all of them together)
    usable_bytes: float
    fits: bool
    runs: bool  # supports the precision
    allowed: bool  # rule 3 (processes) and the strategy's own device limit
    note: str = ""  # why it is not allowed, does not fit or cannot run
    breakdown: dict[str, float] = field(default_factory=dict)  # predicted seconds per phase

    @property
    def eligible(self) -> bool:
        return self.fits and self.runs and self.allowed

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "devices": self.devices,
            "step_seconds": self.step_seconds,
            "source": self.source,
            "peak_bytes": self.peak_bytes,
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "runs": self.runs,
            "allowed": self.allowed,
            "note": self.note,
        }


@dataclass
class Choice:
    """The strategy `auto` chose, on how many devices, the one-line reason, and every candidate it weighed."""

    strategy: str
    devices: int
    reason: str
    candidates: list[Candidate]
    hardware: str  # the hardware the step times are for, in words

    def __str__(self) -> str:
        return self.reason

    def candidate(self, strategy: str) -> Candidate | None:
        return next((c for c in self.candidates if c.strategy == strategy), None)

    def table(self) -> list[str]:
        """The candidates, one line each: step, memory, and why a candidate was out."""
        lines = [f"auto on {self.hardware}:"]
        for c in self.candidates:
            status = "chosen" if c.strategy == self.strategy else ("" if c.eligible else f"out: {c.note}")
            lines.append(
                f"  {c.strategy:<12} {c.devices:>2} dev  {c.step_seconds * 1e3:9.2f} ms ({c.source})  "
                f"peak {c.peak_bytes / 2**30:6.2f} GiB  {status}".rstrip()
            )
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "devices": self.devices,
            "reason": self.reason,
            "hardware": self.hardware,
            "candidates": [c.to_dict() for c in self.candidates],
        }


def choose_strategy(
    model: nn.Module | Callable[[], nn.Module] | ModelProfile,
    sample_input: torch.Tensor | Sequence[int] | None,
    batch_size: int,
    devices: Sequence[DeviceLike],
    precision: str = "32",
    optimizer: str | torch.optim.Optimizer = "sgd",
    can_launch: bool = True,
    calibration: CalibrationSource | None = None,
    *,
    hardware: Hardware | None = None,
    step_seconds: Mapping[str, float] | None = None,
    strategies: Sequence[str] | None = None,
) -> Choice:
    """The strategy to train `model` with on `devices`, by the rules of this module's docstring.

    model: the module (traced on the meta device: its weights are not touched), a factory, or a ModelProfile.
    sample_input: a batch of inputs (its first dimension is the batch; dtype kept) or one sample's shape; not
        needed with a ModelProfile.
    batch_size: the global batch, samples per optimizer step over all devices.
    optimizer: "sgd", "adam", "adamw", or the torch optimizer itself (its state counts in memory).
    devices: the devices given ("cpu:0", "cpu:1" are virtual CPU devices; ints and "cuda:N" are GPUs).
    can_launch: whether a strategy with a process per device may be chosen (the caller starts the processes).
    calibration: see the module docstring; hardware: the GPUs and link to plan for (instead of the catalogue's
        match for the GPUs torch reports); step_seconds: measured step times by strategy for this global batch;
        strategies: the candidates (default: every registered strategy).
    """
    parsed = _parse_devices(devices)
    count = len(parsed)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected a positive number of samples per step, got {batch_size!r}")
    if count > 1 and batch_size < count:
        raise ValueError(
            f"batch_size: {batch_size} samples cannot give each of the {count} devices one; give at least {count}"
        )
    optimizer = _optimizer_name(optimizer)
    names = list(strategies) if strategies is not None else available_strategies()
    for name in names:
        strategy_class(name, argument="strategies")
    one_device = reference()
    if one_device not in names:
        names.insert(0, one_device)
    profile = _profile(model, sample_input)
    on_cpu = parsed[0].type == "cpu"
    machine, constants, described = _machine(parsed, calibration, hardware)
    measured = dict(step_seconds or {})
    unknown = sorted(set(measured) - set(names))
    if unknown:
        raise ValueError(f"step_seconds: {unknown[0]!r} is not one of the candidates ({', '.join(names)})")
    batch = BatchSize(batch_size, per_device=False)
    candidates = [
        _candidate(name, count, profile, machine, constants, batch, precision, optimizer, can_launch, measured)
        for name in names
        if name == one_device or count > 1
    ]
    if count == 1:
        alone = candidates[0]
        if not alone.eligible:
            raise ValueError(f"strategy: auto found nothing that fits on the one device given: {alone.note}")
        return Choice(one_device, 1, f"auto: {one_device} — one device", candidates, described)
    chosen, reason = decide(candidates, on_gpu=not on_cpu)
    return Choice(chosen.strategy, chosen.devices, reason, candidates, described)


def decide(candidates: list[Candidate], on_gpu: bool) -> tuple[Candidate, str]:
    """Rules 2-7 over candidates with their step times: (the chosen one, the reason in one line)."""
    one_device = reference()
    eligible = [c for c in candidates if c.eligible]
    if not eligible:
        raise ValueError("strategy: auto found no strategy that fits and can run: " + _nothing_fits(candidates))
    single = next((c for c in eligible if c.strategy == one_device), None)
    multi = [c for c in eligible if c.strategy != one_device]
    pool, notes = _lightest_pool(single, multi, candidates)
    fastest = min(pool, key=lambda c: c.step_seconds, default=None)
    if single is not None and (fastest is None or fastest.step_seconds * PAYS > single.step_seconds):
        return single, f"auto: {one_device} — " + _why_one_device(single, fastest, candidates)
    if fastest is None:  # only the reference could have run, and it does not fit
        raise ValueError("strategy: auto found no strategy that fits and can run: " + _nothing_fits(candidates))
    equals = sorted((c for c in pool if c.step_seconds <= fastest.step_seconds * EQUALS), key=lambda c: c.step_seconds)
    chosen = equals[0]
    if on_gpu:
        per_device = sorted(
            (c for c in equals if _traits(c).processes == PER_DEVICE),
            key=lambda c: (_sharding(c), c.step_seconds),
        )
        if per_device and per_device[0] is not chosen:
            notes.append(
                f"{per_device[0].strategy} preferred on GPUs (a process per device, no GIL) to {chosen.strategy}, "
                "within 10% of it"
            )
            chosen = per_device[0]
    else:
        in_process = [c for c in equals if _traits(c).processes == ONE_PROCESS]
        if in_process and in_process[0] is not chosen:
            notes.append(f"{in_process[0].strategy} starts no processes; {chosen.strategy} is within 10%")
            chosen = in_process[0]
    if single is not None:
        gain = f"{single.step_seconds / chosen.step_seconds:.2f}x {one_device}'s throughput ({chosen.source})"
    else:
        gain = f"{one_device} does not fit ({_gib(_reference_peak(candidates))} needed)"
    held_back = [
        c.strategy
        for c in candidates
        if c.fits and c.runs and not c.allowed and c.step_seconds < chosen.step_seconds and c.strategy != one_device
    ]
    if held_back:
        notes.append(f"{held_back[0]} would be faster but needs a process per device (can_launch=False)")
    reason = f"auto: {chosen.strategy} on {chosen.devices} devices — {gain}"
    return chosen, reason + "".join(f"; {note}" for note in notes)


# ---- the pieces ---------------------------------------------------------------------------------------------


def _traits(candidate: Candidate) -> Traits:
    return strategy_class(candidate.strategy).traits


def _sharding(candidate: Candidate) -> tuple[int, int]:
    return lightest_sharding(_traits(candidate), candidate.devices, candidate.devices)


def _lightest_pool(
    single: Candidate | None, multi: list[Candidate], candidates: list[Candidate]
) -> tuple[list[Candidate], list[str]]:
    """Rule 4: the multi-device candidates of the lightest sharding that fits (the reference, one device, counts as
    unsharded), with every more sharded one that is 10% faster than all the lighter ones that fit (the advisor's
    SHARDING_WORTH); and a note when nothing unsharded fits."""
    whole = [single] if single is not None else []
    pool = [c for c in lightest_worthwhile(whole + multi, _sharding, lambda c: c.step_seconds) if c is not single]
    notes: list[str] = []
    lightest = min((_sharding(c) for c in whole + multi), default=(0, 1))
    if lightest[0] > 0:
        unfit = [c for c in candidates if not c.fits and _sharding(c) < lightest]
        notes.append(
            "nothing unsharded fits"
            + (
                f" ({unfit[0].strategy} needs {_gib(unfit[0].peak_bytes)} of {_gib(unfit[0].usable_bytes)})"
                if unfit
                else ""
            )
        )
    return pool, notes


def _optimizer_name(optimizer: str | torch.optim.Optimizer) -> str:
    """The cost model's name for an optimizer given by name or as a torch optimizer (others count as Adam: the
    most state, the most traffic)."""
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZER_STATE_BYTES_PER_PARAMETER:
            raise ValueError(
                f"optimizer: expected one of {', '.join(OPTIMIZER_STATE_BYTES_PER_PARAMETER)} or a torch optimizer, "
                f"got {optimizer!r}"
            )
        return optimizer
    name = type(optimizer).__name__.lower()
    return name if name in OPTIMIZER_STATE_BYTES_PER_PARAMETER else "adam"


def _parse_devices(devices: Sequence[DeviceLike]) -> list[torch.device]:
    if isinstance(devices, (str, int, torch.device)) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(f"devices: expected a list of devices such as ['cpu:0', 'cpu:1'] or [0, 1], got {devices!r}")
    parsed = [parse_device(spec, argument=f"devices[{i}]") for i, spec in enumerate(devices)]
    kinds = {device.type for device in parsed}
    if len(kinds) > 1 or kinds - {"cpu", "cuda"}:
        raise ValueError(f"devices: expected only virtual CPU devices or only CUDA devices, got {sorted(kinds)}")
    return parsed


def _profile(
    model: nn.Module | Callable[[], nn.Module] | ModelProfile, sample_input: torch.Tensor | Sequence[int] | None
) -> ModelProfile:
    if isinstance(model, ModelProfile):
        return model
    if not isinstance(model, nn.Module) and not callable(model):
        raise TypeError(f"model: expected a torch.nn.Module, a factory or a ModelProfile, got {type(model).__name__}")
    if isinstance(sample_input, torch.Tensor):
        if sample_input.dim() < 1:
            raise ValueError("sample_input: expected a batch of inputs (first dimension: samples), got a scalar")
        shape, dtype = tuple(sample_input.shape[1:]), sample_input.dtype
    elif isinstance(sample_input, Sequence) and all(isinstance(s, int) and s > 0 for s in sample_input):
        shape, dtype = tuple(sample_input), torch.float32
    else:
        raise ValueError(
            "sample_input: expected a batch of inputs (a tensor) or one sample's shape such as (3, 32, 32), "
            f"got {type(sample_input).__name__}"
        )
    name = type(model).__name__ if isinstance(model, nn.Module) else getattr(model, "__name__", "model")
    return measure_model(model, shape, input_dtype=dtype, name=name)


def host_memory_bytes() -> int:
    """The host's physical memory (virtual CPU devices share it)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not every system names these
        return 64 * 2**30


def _machine(
    devices: list[torch.device], calibration: CalibrationSource | None, hardware: Hardware | None
) -> tuple[Hardware, CostConstants, str]:
    """(hardware, constants, the hardware in words) for the devices given."""
    count = len(devices)
    if devices[0].type == "cpu":
        if hardware is not None:
            fitted = _calibration(calibration, None) if calibration is not None else None
            return hardware, fitted.constants if fitted else CostConstants(), f"{count} virtual CPU devices (given)"
        if calibration is None:
            if count == 1:
                return _one_cpu(), CostConstants(), "1 virtual CPU device"
            from dpkit.plan.probe import probe_machine  # runs the probe models: only when needed

            fitted = probe_machine(count)
        else:
            fitted = _calibration(calibration, None)
            if fitted.hardware is None:
                raise ValueError("calibration: it was fitted on GPUs; virtual CPU devices need a CPU bench's")
        machine, constants = fitted.for_hardware(None)
        machine = replace(machine, gpu=replace(machine.gpu, memory_bytes=host_memory_bytes()))
        return machine, constants, f"{count} virtual CPU devices, constants from {fitted.source}"
    if hardware is None:
        hardware, described = _gpu_hardware(devices)
    else:
        described = f"{count}x {hardware.gpu.name}, link {hardware.link.name} (given)"
    if calibration is None:
        return hardware, CostConstants(), described
    fitted = _calibration(calibration, hardware)
    machine, constants = fitted.for_hardware(hardware)
    return machine, constants, described + f", host constants from {fitted.source}"


def _one_cpu() -> Hardware:
    from dpkit.plan.catalogue import Link

    cpu = GPU(
        "virtual CPU device", {p: 1e10 for p in ("32", "tf32", "bf16-mixed", "16-mixed")}, host_memory_bytes(), 1e10, ""
    )
    return Hardware(cpu, Link("in-process copy", 1e10, 1e10, 2e-6, ""), shared_compute=True)


def _calibration(calibration: CalibrationSource, hardware: Hardware | None) -> Calibration:
    if isinstance(calibration, Calibration):
        return calibration
    if isinstance(calibration, (str, os.PathLike, list, tuple)):
        return calibrate(calibration, hardware)
    raise TypeError(
        "calibration: expected a Calibration or bench JSON path(s) from dpkit bench --json, "
        f"got {type(calibration).__name__}"
    )


def _gpu_hardware(devices: list[torch.device]) -> tuple[Hardware, str]:
    """The catalogue's entry for the GPU torch reports and its usual link; figures assumed when it has none."""
    catalogue = Catalogue.load()
    count = len(devices)
    name = torch.cuda.get_device_name(devices[0]) if torch.cuda.is_available() else "an unknown GPU"
    gpu = catalogue.match_gpu(name)
    if gpu is not None:
        link = catalogue.usual_link(gpu) or catalogue.link("pcie4")
        return Hardware(gpu, link), f"{count}x {gpu.name} ({name}), link {link.name} (its usual one)"
    memory = torch.cuda.get_device_properties(devices[0]).total_memory if torch.cuda.is_available() else 16 * 2**30
    assumed = GPU(
        name,
        {p: 20e12 for p in ("32", "tf32", "bf16-mixed", "16-mixed")},
        memory,
        1e12,
        "assumed: not in dpkit's catalogue (add it with a catalogue file)",
    )
    link = catalogue.link("pcie4")
    return Hardware(assumed, link), f"{count}x {name} (not in the catalogue: 20 TFLOPS and pcie4 assumed)"


def _candidate(
    name: str,
    count: int,
    profile: ModelProfile,
    machine: Hardware,
    constants: CostConstants,
    batch: BatchSize,
    precision: str,
    optimizer: str,
    can_launch: bool,
    measured: Mapping[str, float],
) -> Candidate:
    traits = strategy_class(name).traits
    devices = 1 if traits.max_devices == 1 else count
    allowed, note = True, ""
    if traits.max_devices is not None and count > traits.max_devices > 1:
        allowed, note = False, f"uses at most {traits.max_devices} devices"
    if traits.processes == PER_DEVICE and not can_launch:
        allowed, note = False, "needs a process per device (can_launch=False)"
    if traits.processes == PER_DEVICE and machine.shared_compute and devices > PROCESSES_PER_CORE * available_cores():
        allowed, note = False, f"{devices} processes on {available_cores()} cores"
    setup = Setup(profile, machine, name, devices, batch.share(devices), precision, constants, optimizer)
    prediction = predict_setup(setup, global_batch=batch.samples if devices > 1 else None)
    peak, usable, fits = _memory(setup, prediction)
    runs = runs_at(name, precision)
    if not fits:
        note = note or f"needs {_gib(peak)} of {_gib(usable)} usable"
    elif not runs:
        note = note or f"no GradScaler for precision {precision}"
    seconds, source = prediction.step_seconds, "predicted"
    if name in measured:
        seconds, source = float(measured[name]), "measured"
        if not seconds > 0:
            raise ValueError(f"step_seconds: expected positive seconds for {name!r}, got {measured[name]!r}")
    return Candidate(name, devices, seconds, source, peak, usable, fits, runs, allowed, note, prediction.breakdown)


def _memory(setup: Setup, prediction: Prediction) -> tuple[int, float, bool]:
    """(peak, usable, fits): on virtual CPU devices the devices' peaks add up in the one host memory."""
    usable = setup.hardware.gpu.memory_bytes * USABLE_SHARE
    if not setup.hardware.shared_compute:
        peak = max(prediction.peak_bytes_per_device)
        return peak, usable, peak <= usable
    peaks, _ = memory_per_device(setup)
    return sum(peaks), usable, sum(peaks) <= usable


def _launch_share(candidate: Candidate) -> float:
    launches = candidate.breakdown.get("launch", 0.0) + candidate.breakdown.get("overhead", 0.0)
    total = sum(candidate.breakdown.values())
    return launches / total if total > 0 else 0.0


def _why_one_device(single: Candidate, fastest: Candidate | None, candidates: list[Candidate]) -> str:
    """Why the reference: launch-bound, or what the fastest multi-device candidate loses."""
    if fastest is None:
        out = [c for c in candidates if c.strategy != single.strategy]
        return "no multi-device strategy fits or may run here" + (f" ({out[0].strategy}: {out[0].note})" if out else "")
    ratio = fastest.step_seconds / single.step_seconds
    compared = (
        f"{fastest.strategy} on {fastest.devices} devices would take {ratio:.2f}x {single.strategy}'s step"
        if ratio >= 1
        else f"{fastest.strategy} on {fastest.devices} devices would be only {1 / ratio:.2f}x faster, "
        f"under the {PAYS:.1f}x that pays for more devices"
    )
    dp = min(
        (c for c in candidates if is_data_parallel(_traits(c)) and c.fits and c.runs),
        key=lambda c: c.step_seconds,
        default=None,
    )
    if dp is not None and dp is not fastest:
        compared += f", {dp.strategy} {dp.step_seconds / single.step_seconds:.2f}x"
    sources = {c.source for c in (single, fastest, dp) if c is not None}
    compared += f" ({' and '.join(sorted(sources))})"
    share = _launch_share(single)
    if share >= LAUNCH_BOUND_SHARE:
        return f"on this model a step is mostly operation launches ({share:.0%} of it); {compared}"
    lost = _lost(fastest)
    return compared + (f": it spends {lost}" if lost else "")


def _lost(candidate: Candidate) -> str:
    """The per-step work the candidate adds beyond computing, largest first."""
    step = sum(candidate.breakdown.values())
    parts = sorted(
        ((seconds, name) for name, seconds in candidate.breakdown.items() if name in STATED_PHASES + ("launch",)),
        reverse=True,
    )
    words = phase_words(candidate.strategy)
    shown = [f"{words.get(name, name)} {seconds / step:.0%}" for seconds, name in parts[:2] if seconds / step >= 0.05]
    return ", ".join(shown)


def _reference_peak(candidates: list[Candidate]) -> float:
    return next((c.peak_bytes for c in candidates if c.strategy == reference()), 0)


def _nothing_fits(candidates: list[Candidate]) -> str:
    parts = [f"{c.strategy} on {c.devices}: {c.note or 'excluded'}" for c in candidates]
    return "; ".join(parts) + "; try a smaller batch_size, more devices, or can_launch=True for fsdp"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


__all__ = ["Candidate", "Choice", "choose_strategy", "decide"]
