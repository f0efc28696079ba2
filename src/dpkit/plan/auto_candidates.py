"""`auto`'s candidates: a strategy on its devices, with its step time for the global batch (the cost model's
prediction, or a measured one), its peak memory, and whether rules 2 and 3 allow it (it fits, runs at the
precision, may start its processes); and what they are predicted from, the model's profile and the optimizer."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpkit.devices import PROCESSES_PER_CORE, available_cores
from dpkit.plan.advice_words import gib
from dpkit.plan.configuration import BatchSize, Hardware, Setup, runs_at
from dpkit.plan.constants import OPTIMIZER_STATE_BYTES_PER_PARAMETER, CostConstants
from dpkit.plan.cost_model import Prediction, predict_setup
from dpkit.plan.memory import memory_per_device
from dpkit.plan.periodic_sync import meets_periodically
from dpkit.plan.profiles import ModelProfile, measure_model
from dpkit.strategies import PER_DEVICE, strategy_class

USABLE_SHARE = 0.9  # of a GPU's memory, or of the host's for virtual CPU devices together
# why auto never picks a strategy whose replicas train alone and meet every H steps (localsgd, diloco)
CHANGES_THE_OPTIMIZATION = "changes the optimization (replicas trained alone, meeting every H steps): never chosen"


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


def make_candidate(
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
    if meets_periodically(name):
        allowed, note = False, CHANGES_THE_OPTIMIZATION
    setup = Setup(profile, machine, name, devices, batch.share(devices), precision, constants, optimizer)
    prediction = predict_setup(setup, global_batch=batch.samples if devices > 1 else None)
    peak, usable, fits = _memory(setup, prediction)
    runs = runs_at(name, precision)
    if not fits:
        note = note or f"needs {gib(peak)} of {gib(usable)} usable"
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


def optimizer_name(optimizer: str | torch.optim.Optimizer) -> str:
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


def model_profile(
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
