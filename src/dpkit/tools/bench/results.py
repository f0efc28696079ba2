"""The bench's results side by side: each configuration's step time, throughput, speed-up and efficiency,
where the time went against one device (lost_by_phase), and the whole run as a table, JSON or a figure."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dpkit.devices import resolve_devices
from dpkit.observe.plots import PhaseBar, save_scaling_figure
from dpkit.observe.report import write_json
from dpkit.observe.timing import PHASES
from dpkit.strategies import reference
from dpkit.tools.bench.spec import BenchSpec

SCHEMA_VERSION = 1
SHOWN_PHASES = tuple(PHASES) + tuple(p for p in ("all_reduce", "all_reduce_hidden") if p not in PHASES)


@dataclass
class ConfigResult:
    strategy: str
    devices: int
    step_seconds: float
    step_seconds_samples: list[float]
    phase_seconds: dict[str, float]
    samples_per_second: float = 0.0
    speedup: float = 0.0
    efficiency: float = 0.0
    lost: dict[str, float] = field(default_factory=dict)  # fraction of this step lost to each phase vs one device
    fastest_step_seconds: float = 0.0  # the least disturbed step
    interleaved: bool = True  # took turns with the others, round by round (ddp, fsdp run in their own processes)
    reference_seconds_samples: list[float] = field(default_factory=list)  # the reference work of each step's round

    def summary(self) -> str:
        text = f"{self.devices} device{'s' if self.devices > 1 else ''}: {self.speedup:.2f}x ({self.efficiency:.0%})"
        parts = [
            f"{name} {share:.0%}" for name, share in sorted(self.lost.items(), key=lambda kv: -kv[1]) if share >= 0.005
        ]
        return text + (f"; lost to {', '.join(parts)}" if parts else "")


@dataclass
class BenchResult:
    spec: BenchSpec
    profile: dict[str, Any]
    machine: dict[str, Any]
    results: list[ConfigResult]

    def baseline(self) -> ConfigResult:
        one_device = [r for r in self.results if r.devices == 1]
        return next(
            (r for r in one_device if r.strategy == reference()), one_device[0] if one_device else self.results[0]
        )

    def to_dict(self) -> dict[str, Any]:
        spec = asdict(self.spec)
        spec.pop("progress")
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "dpkit-bench",
            "spec": spec,
            "model": self.profile,
            "machine": self.machine,
            "batch_size_per_device": self.spec.batch_size_per_device,
            "batch_size": self.spec.batch_size,
            "optimizer": self.spec.optimizer,
            "precision": str(self.spec.precision),
            "results": [{**asdict(r), "summary": r.summary()} for r in self.results],
        }

    def save_json(self, path: str | os.PathLike) -> Path:
        return write_json(self.to_dict(), path)

    def format_table(self) -> str:
        phases = [p for p in SHOWN_PHASES if any(p in r.phase_seconds for r in self.results)]
        header = (
            ["strategy", "devices", "step ms", "samples/s", "speedup", "eff"]
            + [f"{p} ms" for p in phases]
            + ["where it went"]
        )
        rows = []
        for r in self.results:
            row = [
                r.strategy,
                str(r.devices),
                f"{r.step_seconds * 1e3:.2f}",
                f"{r.samples_per_second:,.0f}",
                f"{r.speedup:.2f}x",
                f"{r.efficiency:.0%}",
            ]
            row += [f"{r.phase_seconds[p] * 1e3:.2f}" if p in r.phase_seconds else "-" for p in phases]
            row.append(r.summary().split(": ", 1)[1])
            rows.append(row)
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
        lines = ["  ".join(h.rjust(w) if i < len(header) - 1 else h for i, (h, w) in enumerate(zip(header, widths)))]
        lines += [
            "  ".join(c.rjust(w) if i < len(header) - 1 else c for i, (c, w) in enumerate(zip(row, widths)))
            for row in rows
        ]
        return "\n".join(lines)

    def save_png(self, path: str | os.PathLike) -> Path:
        """Left: samples/s against devices per strategy; right: stacked time by phase per configuration."""
        throughput: dict[str, list[tuple[int, float]]] = {}
        for r in self.results:
            throughput.setdefault(r.strategy, []).append((r.devices, r.samples_per_second))
        return save_scaling_figure(
            path,
            throughput,
            [PhaseBar(r.strategy, r.devices, r.phase_seconds) for r in self.results],
            [p for p in SHOWN_PHASES if not p.endswith("_hidden")],  # hidden time is inside another phase
            title=f"throughput, {self.spec.batch_description()}",
            throughput_label="samples/s (median step)",
            phase_label="ms per observed step (slowest device per phase)",
            linear_from=self.baseline().samples_per_second,
            reference=reference(),
        )


def lost_by_phase(result: ConfigResult, baseline: ConfigResult) -> dict[str, float]:
    """The share of this configuration's step that the one-device step did not spend, by phase:
    phases that grew (communication, serialised launches, shared compute) against the baseline's."""
    lost_total = max(0.0, 1.0 - baseline.step_seconds / result.step_seconds) if result.step_seconds > 0 else 0.0
    step_phases = {phase: seconds for phase, seconds in result.phase_seconds.items() if not phase.endswith("_hidden")}
    grown = {phase: seconds - baseline.phase_seconds.get(phase, 0.0) for phase, seconds in step_phases.items()}
    grown = {phase: extra for phase, extra in grown.items() if extra > 0}
    observed_total = sum(step_phases.values())
    if not grown or lost_total == 0 or observed_total == 0:
        return {"other": lost_total} if lost_total > 0.005 else {}
    # observed steps run slower than the timed ones (observing costs); express growth in their scale
    shares = {phase: extra / observed_total for phase, extra in grown.items()}
    explained = sum(shares.values())
    if explained > lost_total:  # never claim more than was lost
        shares = {phase: share * lost_total / explained for phase, share in shares.items()}
    elif lost_total - explained > 0.005:
        shares["other"] = lost_total - explained
    return shares


def machine_description(spec: BenchSpec) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    devices = resolve_devices(spec.accelerator, 1)
    described = {
        "accelerator": devices[0].type,
        "cores": cores,
        "torch": torch.__version__,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if devices[0].type == "cuda":
        described["device_name"] = torch.cuda.get_device_name(0)
    return described
