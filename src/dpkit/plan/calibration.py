"""Fitting the cost model's constants to a `dpkit bench` run (`dpkit plan --calibration bench.json`).

The bench JSON holds the measured model profile and, per (strategy, devices), the median step time.
The fit chooses the constants that make the cost model's step times match, by least squares on the
log of predicted over measured time (so a 10% miss weighs the same on a 2 ms and a 200 ms step), with
a weak pull toward the starting values so that a constant the bench cannot see stays sensible.

What is fitted depends on where the bench ran:
- virtual CPU devices: the machine itself is unknown, so its compute rate per device, the number of
  devices that compute at full speed at once, the in-process copy bandwidth, the bandwidth and latency
  between processes (gloo), and the host constants;
- GPUs: the catalogue gives the hardware (`--gpu`, `--link`), and the fit finds the share of peak the
  model reaches and the host constants.
The host constants are a step's fixed costs: per kernel launched, per step, per hand-off to the replicas'
threads, per module and per parameter tensor DataParallel re-makes for each replica at each step, and how the
replica threads of one process serialise on the GIL (HOST_KNOBS). Several bench runs can be fitted at once
(`calibrate([a, b])`, `dpkit plan --calibration a.json --calibration b.json`): a model whose step is mostly
launches beside one whose step is mostly arithmetic tells the fixed costs from the compute rate.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpkit.plan.catalogue import GPU, PRECISIONS, Link
from dpkit.plan.configuration import Hardware
from dpkit.plan.constants import CostConstants
from dpkit.plan.cost_model import predict
from dpkit.plan.profiles import ModelProfile

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

HOST_MEMORY_BYTES = 64 * 2**30  # virtual CPU devices: memory is not what the fit is about


@dataclass
class BenchRun:
    """What the cost model needs from a bench JSON."""

    profile: ModelProfile
    batch_per_device: int
    optimizer: str
    accelerator: str
    cores: int
    measured: list[tuple[str, int, float]]  # (strategy, devices, median step seconds)
    path: str = ""
    reference_seconds: float | None = None  # the bench's fixed reference work: how fast the machine was
    batch_size: int | None = None  # a global batch split across the devices (then batch_per_device is 0)

    def share(self, devices: int) -> int:
        """Samples per device of the configuration on `devices` devices."""
        return self.batch_per_device if self.batch_size is None else -(-self.batch_size // devices)

    def predict_step(self, strategy: str, devices: int, hardware: Hardware, constants: CostConstants) -> float:
        """The cost model's step time for one of this bench's configurations."""
        return predict(
            self.profile,
            hardware,
            strategy,
            devices,
            self.share(devices),
            "32",
            constants,
            self.optimizer,
            global_batch=self.batch_size,
        ).step_seconds

    @classmethod
    def load(
        cls, path: str | os.PathLike, statistic: str = "median", reference_seconds: float | None = None
    ) -> BenchRun:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"calibration: no bench JSON at {str(path)!r}; write one with `dpkit bench --json {path}`"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"calibration: {str(path)!r} is not JSON ({error})") from None
        if data.get("kind") != "dpkit-bench" or "results" not in data:
            raise ValueError(
                f"calibration: {str(path)!r} is not a dpkit bench JSON (no kind 'dpkit-bench' with results)"
            )
        return cls.from_dict(data, str(path), statistic, reference_seconds)

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], path: str = "", statistic: str = "median", reference_seconds: float | None = None
    ) -> BenchRun:
        """statistic "median": the bench's median step; "fastest": each configuration's least disturbed
        step; "relative": the median of each step over the reference work timed in the same round,
        times `reference_seconds` (default: this run's median reference), which takes out the load
        that other work put on the machine while this run went on."""
        machine = data.get("machine", {})
        references = machine.get("reference_seconds_samples") or []  # older files: one per round
        if statistic not in ("fastest", "median", "relative"):
            raise ValueError(f"statistic: expected 'median', 'fastest' or 'relative', got {statistic!r}")
        measured = []
        for r in data["results"]:
            seconds = float(r["step_seconds"])
            if statistic == "fastest":
                seconds = float(r.get("fastest_step_seconds") or seconds)
            elif statistic == "relative" and r.get("interleaved", True):
                own = r.get("reference_seconds_samples") or references  # the reference of each step's round
                if own and len(own) == len(r["step_seconds_samples"]):
                    scale = reference_seconds or float(machine["reference_seconds"])
                    seconds = scale * statistics.median(t / ref for t, ref in zip(r["step_seconds_samples"], own))
            measured.append((r["strategy"], int(r["devices"]), seconds))
        global_batch = data.get("batch_size")
        return cls(
            ModelProfile.from_dict(data["model"]),
            0 if global_batch else int(data["batch_size_per_device"]),
            data.get("optimizer", "adam"),
            machine.get("accelerator", "cpu"),
            int(machine.get("cores", 1)),
            measured,
            path,
            machine.get("reference_seconds"),
            int(global_batch) if global_batch else None,
        )


# ---- the parameters the fit moves ------------------------------------------------------------------


@dataclass(frozen=True)
class Knob:
    name: str
    start: float
    low: float
    high: float


# the host's per-step fixed costs, the same on virtual CPU devices and beside GPUs: per kernel launched, per step,
# per hand-off to the replicas' threads, per module and per parameter tensor DataParallel re-makes for each replica
# at each step, and the share of launching that holds the GIL (how one process's replica threads serialise)
HOST_KNOBS = (
    Knob("launch_seconds", 1e-5, 1e-7, 1e-3),
    Knob("step_overhead_seconds", 5e-4, 1e-6, 1e-1),
    Knob("thread_seconds", 1e-4, 1e-7, 1e-1),
    Knob("module_seconds", 1e-5, 1e-8, 1e-2),
    Knob("tensor_seconds", 5e-6, 1e-8, 1e-2),
    Knob("gil_share", 1.5, 0.05, 4.0),
)
CPU_KNOBS = (
    Knob("flops_per_second", 5e9, 1e7, 1e13),
    Knob("compute_slots", 1.5, 1.0, 64.0),
    Knob("copy_bytes_per_second", 5e9, 1e7, 1e12),
    Knob("interprocess_bytes_per_second", 1e9, 1e6, 1e11),
    Knob("interprocess_latency_seconds", 1e-4, 1e-6, 1e-1),
    *HOST_KNOBS,
)
GPU_KNOBS = (
    Knob("compute_efficiency", 0.45, 0.01, 1.0),
    Knob("launch_seconds", 6e-6, 1e-7, 1e-3),
    Knob("step_overhead_seconds", 1e-3, 1e-6, 1e-1),
    Knob("thread_seconds", 6e-5, 1e-7, 1e-1),
    Knob("module_seconds", 8e-6, 1e-8, 1e-2),
    Knob("tensor_seconds", 4e-6, 1e-8, 1e-2),
    Knob("gil_share", 1.5, 0.05, 4.0),
)
HOST_CONSTANTS = tuple(knob.name for knob in HOST_KNOBS)  # what carries over from one machine to another's GPUs


def host_constants(values: dict[str, float], **others: Any) -> CostConstants:
    """CostConstants with the fitted host constants of `values` (and `others`), marked as fitted."""
    # (Any: the constants' fields are of several types, and mypy checks a ** dict against each of them)
    fitted: dict[str, Any] = {name: values[name] for name in HOST_CONSTANTS if name in values}
    return CostConstants(**fitted, **others, fitted=tuple(fitted) + tuple(others))


def cpu_machine(values: dict[str, float], cores: int, source: str) -> tuple[Hardware, CostConstants]:
    """The machine a CPU bench ran on, as the cost model sees it, from fitted values."""
    copy = Link("in-process copy", values["copy_bytes_per_second"], values["copy_bytes_per_second"], 2e-6, source)
    interprocess = Link(
        "gloo (loopback)",
        values["interprocess_bytes_per_second"],
        values["interprocess_bytes_per_second"],
        values["interprocess_latency_seconds"],
        source,
    )
    cpu = GPU(
        "virtual CPU device",
        # one fitted rate: the bench measures float32, and autocast on a CPU is not the tensor cores' jump
        {precision: values["flops_per_second"] for precision in PRECISIONS},
        HOST_MEMORY_BYTES,
        values["copy_bytes_per_second"],
        source,
    )
    hardware = Hardware(
        cpu,
        copy,
        shared_compute=True,
        compute_slots=min(values["compute_slots"], max(1, cores)),
        interprocess=interprocess,
    )
    constants = host_constants(values, compute_efficiency=1.0)
    return hardware, replace(constants, source=f"fitted to {source}")


@dataclass
class Calibration:
    hardware: Hardware | None  # the bench's own machine (CPU benches); None for GPU benches
    constants: CostConstants
    values: dict[str, float]
    fit_errors: list[tuple[str, int, float]] = field(default_factory=list)  # (strategy, devices, relative error)
    source: str = ""
    reference_seconds: float | None = None

    @property
    def median_abs_error(self) -> float:
        return statistics.median(abs(e) for _, _, e in self.fit_errors) if self.fit_errors else 0.0

    def for_hardware(self, hardware: Hardware | None) -> tuple[Hardware, CostConstants]:
        """The hardware to plan on (the bench's own when none is named) with the fitted constants. On
        other hardware only the host constants carry over (a CPU's FLOP rate says nothing of a GPU's)."""
        if hardware is None:
            if self.hardware is None:
                raise ValueError("gpu/link: a calibration from a GPU bench needs the GPU and the link named")
            return self.hardware, self.constants
        if self.hardware is not None:
            carried = {name: getattr(self.constants, name) for name in HOST_CONSTANTS}
            return hardware, replace(CostConstants(), **carried, fitted=HOST_CONSTANTS, source=self.constants.source)
        return hardware, self.constants


def calibrate(
    bench: BenchRun | str | os.PathLike | Sequence[BenchRun | str | os.PathLike], hardware: Hardware | None = None
) -> Calibration:
    """Fit the constants to one bench run, or to several at once (for a GPU bench, `hardware` is the catalogue's
    machine). Several runs (two models, say: one whose step is mostly launches, one mostly arithmetic) tell the
    host's fixed costs apart from the compute rate better than one; each run's steps are taken relative to the
    reference work of its rounds, on the first run's scale, so that load that differed between runs made one
    after another cancels out."""
    import numpy as np
    from scipy.optimize import least_squares

    runs = load_runs(bench)
    if not any(run.measured for run in runs):
        raise ValueError("calibration: the bench JSON has no results to fit")
    accelerators = {run.accelerator == "cpu" for run in runs}
    if len(accelerators) > 1:
        raise ValueError("calibration: the bench runs mix virtual CPU devices and GPUs; fit them separately")
    on_cpu = accelerators.pop()
    if not on_cpu and hardware is None:
        raise ValueError("calibration: the bench ran on GPUs; name them (gpu=... link=...) to fit against their peak")
    knobs = CPU_KNOBS if on_cpu else GPU_KNOBS
    source = ", ".join(Path(run.path).name for run in runs if run.path) or "a bench run"
    cores = max(run.cores for run in runs)
    configurations = [(run, strategy, devices, seconds) for run in runs for strategy, devices, seconds in run.measured]

    def machine(vector: npt.NDArray[np.float64]) -> tuple[Hardware, CostConstants]:
        values = {k.name: float(math.exp(v)) for k, v in zip(knobs, vector)}
        if on_cpu:
            return cpu_machine(values, cores, source)
        assert hardware is not None  # a GPU bench without its hardware was refused above
        constants = host_constants(values, compute_efficiency=values["compute_efficiency"])
        return hardware, replace(constants, source=f"fitted to {source}")

    def predicted(vector: npt.NDArray[np.float64]) -> list[float]:
        used_hardware, constants = machine(vector)
        return [
            run.predict_step(strategy, devices, used_hardware, constants)
            for run, strategy, devices, _ in configurations
        ]

    start = np.log([k.start for k in knobs])
    measured = np.array([seconds for *_, seconds in configurations])
    prior_weight = 0.05  # weak: each knob may move by orders of magnitude when the data ask for it

    def residuals(vector: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        fit = np.log(np.array(predicted(vector)) / measured)
        return np.concatenate([fit, prior_weight * (vector - start)])

    bounds = (np.log([k.low for k in knobs]), np.log([k.high for k in knobs]))
    solution = least_squares(residuals, start, bounds=bounds, method="trf", x_scale=1.0, diff_step=1e-3)
    values = {k.name: float(math.exp(v)) for k, v in zip(knobs, solution.x)}
    used_hardware, constants = machine(solution.x)
    errors = [(s, n, p / m - 1.0) for (_, s, n, m), p in zip(configurations, predicted(solution.x))]
    return Calibration(used_hardware if on_cpu else None, constants, values, errors, source, runs[0].reference_seconds)


def load_runs(bench: BenchRun | str | os.PathLike | Sequence[BenchRun | str | os.PathLike]) -> list[BenchRun]:
    """One or several bench runs, paths loaded relative to their reference work on the first run's scale."""
    items = [bench] if isinstance(bench, (BenchRun, str, os.PathLike)) else list(bench)
    if not items:
        raise ValueError("calibration: expected at least one bench JSON")
    runs: list[BenchRun] = []
    for item in items:
        if isinstance(item, BenchRun):
            runs.append(item)
        else:
            scale = runs[0].reference_seconds if runs else None
            runs.append(BenchRun.load(item, "relative", scale))
    return runs


def load_ratio(calibration: Calibration, run: BenchRun) -> float:
    """How much slower the machine ran `run` than the calibration run, by their reference work (1.0
    when either lacks it). On a machine shared with other work this moves every step time alike."""
    if not calibration.reference_seconds or not run.reference_seconds:
        return 1.0
    return run.reference_seconds / calibration.reference_seconds


def prediction_errors(
    calibration: Calibration, run: BenchRun, *, correct_load: bool = True
) -> list[tuple[str, int, float, float]]:
    """(strategy, devices, predicted seconds, measured seconds) for every configuration of another run;
    with correct_load the predictions are scaled by the runs' reference-work ratio."""
    hardware, constants = calibration.for_hardware(None)
    scale = load_ratio(calibration, run) if correct_load else 1.0
    return [
        (strategy, devices, scale * run.predict_step(strategy, devices, hardware, constants), seconds)
        for strategy, devices, seconds in run.measured
    ]
