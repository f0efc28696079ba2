"""Fitting the cost model's constants to a `dpkit bench` run (`dpkit plan --calibration bench.json`).

The bench JSON holds the measured model profile and, per (strategy, devices), the median step time.
The fit chooses the constants that make the cost model's step times match, by least squares on the
log of predicted over measured time (so a 10% miss weighs the same on a 2 ms and a 200 ms step), with
a weak pull toward the starting values so that a constant the bench cannot see stays sensible.

What is fitted depends on where the bench ran:
- virtual CPU devices: the machine itself is unknown, so its compute rate per device, the number of
  devices that compute at full speed at once, the in-process copy bandwidth, the bandwidth and latency
  between processes (gloo), and the host constants (launch, per-step and per-thread overheads);
- GPUs: the catalogue gives the hardware (`--gpu`, `--link`), and the fit finds the share of peak the
  model reaches and the host constants.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dpkit.plan.catalogue import GPU, Link
from dpkit.plan.cost_model import CostConstants, Hardware, predict
from dpkit.plan.profiles import ModelProfile

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
        return cls(
            ModelProfile.from_dict(data["model"]),
            int(data["batch_size_per_device"]),
            data.get("optimizer", "adam"),
            machine.get("accelerator", "cpu"),
            int(machine.get("cores", 1)),
            measured,
            path,
            machine.get("reference_seconds"),
        )


# ---- the parameters the fit moves ------------------------------------------------------------------


@dataclass(frozen=True)
class Knob:
    name: str
    start: float
    low: float
    high: float


CPU_KNOBS = (
    Knob("flops_per_second", 5e9, 1e7, 1e13),
    Knob("compute_slots", 1.5, 1.0, 64.0),
    Knob("copy_bytes_per_second", 5e9, 1e7, 1e12),
    Knob("interprocess_bytes_per_second", 1e9, 1e6, 1e11),
    Knob("interprocess_latency_seconds", 1e-4, 1e-6, 1e-1),
    Knob("launch_seconds", 1e-5, 1e-7, 1e-3),
    Knob("step_overhead_seconds", 5e-4, 1e-6, 1e-1),
    Knob("thread_seconds", 1e-4, 1e-7, 1e-1),
)
GPU_KNOBS = (
    Knob("compute_efficiency", 0.45, 0.01, 1.0),
    Knob("launch_seconds", 6e-6, 1e-7, 1e-3),
    Knob("step_overhead_seconds", 1e-3, 1e-6, 1e-1),
    Knob("thread_seconds", 6e-5, 1e-7, 1e-1),
)


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
        {"32": values["flops_per_second"]},
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
    constants = CostConstants(
        compute_efficiency=1.0,
        launch_seconds=values["launch_seconds"],
        step_overhead_seconds=values["step_overhead_seconds"],
        thread_seconds=values["thread_seconds"],
        source=f"fitted to {source}",
    )
    return hardware, constants


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
            return hardware, replace(
                CostConstants(),
                launch_seconds=self.constants.launch_seconds,
                step_overhead_seconds=self.constants.step_overhead_seconds,
                thread_seconds=self.constants.thread_seconds,
                source=self.constants.source,
            )
        return hardware, self.constants


def calibrate(bench: BenchRun | str | os.PathLike, hardware: Hardware | None = None) -> Calibration:
    """Fit the constants to one bench run (for a GPU bench, `hardware` is the catalogue's machine)."""
    import numpy as np
    from scipy.optimize import least_squares

    run = bench if isinstance(bench, BenchRun) else BenchRun.load(bench, "relative")
    if not run.measured:
        raise ValueError("calibration: the bench JSON has no results to fit")
    on_cpu = run.accelerator == "cpu"
    if not on_cpu and hardware is None:
        raise ValueError("calibration: the bench ran on GPUs; name them (gpu=... link=...) to fit against their peak")
    knobs = CPU_KNOBS if on_cpu else GPU_KNOBS
    source = Path(run.path).name if run.path else "a bench run"

    def machine(vector: Any) -> tuple[Hardware, CostConstants]:
        values = {k.name: float(math.exp(v)) for k, v in zip(knobs, vector)}
        if on_cpu:
            return cpu_machine(values, run.cores, source)
        return hardware, CostConstants(
            compute_efficiency=values["compute_efficiency"],
            launch_seconds=values["launch_seconds"],
            step_overhead_seconds=values["step_overhead_seconds"],
            thread_seconds=values["thread_seconds"],
            source=f"fitted to {source}",
        )

    def predicted(vector: Any) -> list[float]:
        used_hardware, constants = machine(vector)
        return [
            predict(
                run.profile, used_hardware, strategy, devices, run.batch_per_device, "32", constants, run.optimizer
            ).step_seconds
            for strategy, devices, _ in run.measured
        ]

    start = np.log([k.start for k in knobs])
    measured = np.array([seconds for _, _, seconds in run.measured])
    prior_weight = 0.05  # weak: each knob may move by orders of magnitude when the data ask for it

    def residuals(vector: Any) -> Any:
        fit = np.log(np.array(predicted(vector)) / measured)
        return np.concatenate([fit, prior_weight * (vector - start)])

    bounds = (np.log([k.low for k in knobs]), np.log([k.high for k in knobs]))
    solution = least_squares(residuals, start, bounds=bounds, method="trf", x_scale=1.0, diff_step=1e-3)
    values = {k.name: float(math.exp(v)) for k, v in zip(knobs, solution.x)}
    used_hardware, constants = machine(solution.x)
    errors = [(s, n, p / m - 1.0) for (s, n, m), p in zip(run.measured, predicted(solution.x))]
    return Calibration(used_hardware if on_cpu else None, constants, values, errors, source, run.reference_seconds)


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
        (
            strategy,
            devices,
            scale
            * predict(
                run.profile, hardware, strategy, devices, run.batch_per_device, "32", constants, run.optimizer
            ).step_seconds,
            seconds,
        )
        for strategy, devices, seconds in run.measured
    ]
