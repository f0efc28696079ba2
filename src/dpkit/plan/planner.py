"""A plan: every prediction, the recommendation, and the ways to show them (table, JSON, PNG)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dpkit.observe.plots import save_scaling_figure
from dpkit.observe.report import write_json
from dpkit.plan.advisor import Recommendation, recommend
from dpkit.plan.catalogue import Link
from dpkit.plan.cost_model import PHASE_ORDER, CostConstants, Hardware, Prediction, Sizing, predict_all
from dpkit.plan.profiles import ModelProfile
from dpkit.strategies import reference


@dataclass
class Plan:
    profile: ModelProfile
    hardware: Hardware
    predictions: list[Prediction]
    recommendation: Recommendation
    constants: CostConstants
    precision: str = "32"
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        hardware = {
            "gpu": self.hardware.gpu.name,
            "link": self.hardware.link.name,
            "network": self.hardware.network.name if self.hardware.network else None,
            "nodes": self.hardware.nodes,
        }
        return {
            "model": self.profile.to_dict(),
            "hardware": hardware,
            "precision": self.precision,
            "constants": self.constants.to_dict(),
            **self.meta,
            "predictions": [p.to_dict() for p in self.predictions],
            "recommendation": self.recommendation.to_dict(),
        }

    def save_json(self, path: str | Path) -> Path:
        return write_json(self.to_dict(), path)

    def format_table(self) -> str:
        phases = [name for name in PHASE_ORDER if any(name in p.breakdown for p in self.predictions)]
        header = (
            ["strategy", "nodes", "devices", "step ms", "samples/s", "speedup", "eff"]
            + [f"{p} ms" for p in phases]
            + ["peak GiB", "max batch"]
        )
        rows = []
        for p in self.predictions:
            row = [
                p.strategy,
                str(p.nodes),
                str(p.devices),
                f"{p.step_seconds * 1e3:.2f}",
                f"{p.samples_per_second:,.0f}",
                f"{p.speedup:.2f}x",
                f"{p.efficiency:.0%}",
            ]
            row += [f"{p.breakdown.get(name, 0.0) * 1e3:.2f}" for name in phases]
            row += [
                f"{max(p.peak_bytes_per_device) / 2**30:.1f}" + ("" if p.fits else "!"),
                str(p.max_batch_per_device),
            ]
            rows.append(row)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        if any(not p.fits for p in self.predictions):
            lines.append("! does not fit in the device's usable memory")
        cannot = sorted({p.strategy for p in self.predictions if not p.runs})
        if cannot:
            lines.append(f"cannot run at precision {self.precision}: {', '.join(cannot)} (no GradScaler)")
        recommendation = self.recommendation
        if recommendation.strategy is None:
            lines.append("recommendation: none (nothing fits; what would:)")
        else:
            lines.append(
                f"recommendation: {recommendation.strategy}"
                + (f" on {recommendation.devices} devices" if recommendation.devices > 1 else "")
            )
        lines += [f"  - {reason}" for reason in recommendation.reasons]
        return "\n".join(lines)

    def save_png(self, path: str | Path) -> Path:
        """Left: predicted samples/s against devices per strategy, for the configurations that fit (all of them
        when none does); right: the step broken into phases, a "!" on the configurations that do not fit."""
        fitting = [p for p in self.predictions if p.fits and p.runs] or self.predictions
        throughput: dict[str, list[tuple[int, float]]] = {}
        for p in fitting:
            throughput.setdefault(p.strategy, []).append((p.total_devices, p.samples_per_second))
        return save_scaling_figure(
            path,
            throughput,
            [
                (f"{p.strategy}\n{p.total_devices}" + ("" if p.fits and p.runs else " !"), p.breakdown)
                for p in self.predictions
            ],
            PHASE_ORDER,
            title=f"{self.profile.name} on {self.hardware.gpu.name} / {self.hardware.link.name}",
            throughput_label="samples/s (predicted)",
            phase_label="ms per step (predicted)",
            reference=reference(),
        )


def faster_link(hardware: Hardware, links: dict[str, Link]) -> Hardware | None:
    """The same machine with the fastest catalogued link (None if it already has it)."""
    fastest = max(links.values(), key=lambda link: link.achieved_bytes_per_second)
    if fastest.achieved_bytes_per_second <= hardware.link.achieved_bytes_per_second:
        return None
    return replace(hardware, link=fastest, interprocess=None)


def make_plan(
    profile: ModelProfile,
    hardware: Hardware,
    strategies: list[str],
    device_counts: list[int],
    batch_per_device: int,
    precision: str = "32",
    constants: CostConstants = CostConstants(),
    optimizer: str = "adam",
    links: dict[str, Link] | None = None,
    networks: dict[str, Link] | None = None,
) -> Plan:
    predictions = predict_all(
        profile, hardware, strategies, device_counts, batch_per_device, precision, constants, optimizer
    )

    def what_if(change: str) -> list[Prediction]:
        if change == "faster-link":
            other = faster_link(hardware, links) if links else None
            return (
                predict_all(
                    profile, other, strategies, device_counts, batch_per_device, precision, constants, optimizer
                )
                if other
                else []
            )
        if change == "faster-network":
            if hardware.nodes < 2 or not networks or hardware.network is None:
                return []
            fastest = max(networks.values(), key=lambda link: link.achieved_bytes_per_second)
            if fastest.achieved_bytes_per_second <= hardware.network.achieved_bytes_per_second:
                return []
            return predict_all(
                profile,
                replace(hardware, network=fastest),
                strategies,
                device_counts,
                batch_per_device,
                precision,
                constants,
                optimizer,
            )
        if change == "double-batch":
            return predict_all(
                profile, hardware, strategies, device_counts, 2 * batch_per_device, precision, constants, optimizer
            )
        return []

    recommendation = recommend(
        predictions,
        hardware.link.name,
        hardware.network.name if hardware.network else "",
        what_if,
        Sizing(profile, hardware, batch_per_device, precision, optimizer, constants),
    )
    return Plan(
        profile,
        hardware,
        predictions,
        recommendation,
        constants,
        precision,
        {"batch_size_per_device": batch_per_device, "optimizer": optimizer},
    )
