"""A plan: every prediction, the recommendation, and the ways to show them (table, JSON, PNG)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpkit.observe.plots import save_scaling_figure
from dpkit.observe.report import write_json
from dpkit.plan.advisor import Recommendation, recommend
from dpkit.plan.catalogue import Link
from dpkit.plan.compression_advice import add_compression_advice
from dpkit.plan.configuration import BatchSize, Hardware, as_batch
from dpkit.plan.constants import CostConstants
from dpkit.plan.cost_model import Prediction
from dpkit.plan.memory import Sizing
from dpkit.plan.memory_rows import MEMORY_COLUMNS, MemoryRow, memory_rows
from dpkit.plan.profiles import ModelProfile
from dpkit.plan.reruns import Reruns
from dpkit.plan.step_time import PHASE_ORDER
from dpkit.plan.tables import fitted_table, wrap
from dpkit.strategies import reference
from dpkit.strategies.compression import Compression, parse_compression


@dataclass
class Plan:
    profile: ModelProfile
    hardware: Hardware
    predictions: list[Prediction]
    recommendation: Recommendation
    constants: CostConstants
    precision: str = "32"
    meta: dict[str, Any] = field(default_factory=dict)
    memory: list[MemoryRow] = field(default_factory=list)  # by category, every strategy asked and its variants

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
            "memory_by_category": [row.to_dict() for row in self.memory],
            "recommendation": self.recommendation.to_dict(),
        }

    def save_json(self, path: str | Path) -> Path:
        return write_json(self.to_dict(), path)

    def format_table(self) -> str:
        """The predictions in two tables within WIDTH columns (the summary, then the step by phase), the marks
        explained, and the recommendation with its reasons."""
        memory = self.memory_lines()
        return "\n".join(
            self.summary_lines() + [""] + self.phase_lines() + [""] + memory + ([""] if memory else [])
            + self.recommendation_lines()
        )  # fmt: skip

    def _label(self, p: Prediction) -> list[str]:
        devices = f"{p.nodes}x{p.devices}" if self.hardware.nodes > 1 else str(p.devices)
        return [p.label, devices]

    def summary_lines(self) -> list[str]:
        per_device = all(p.global_batch is None for p in self.predictions)
        compressing = self.meta.get("compress", "none") != "none"
        header = ["strategy", "devices"] + (["compress"] if compressing else []) + ([] if per_device else ["batch/dev"])
        header += ["step ms", "samples/s", "speedup", "eff", "peak GiB", "max batch"]
        rows = []
        for p in self.predictions:
            strategy, devices = self._label(p)
            row = [strategy + ("" if p.runs else "*"), devices]
            row += ([p.compress if p.total_devices > 1 else "-"] if compressing else []) + (
                [] if per_device else [str(p.batch_per_device)]
            )
            row += [
                _step_milliseconds(p.step_seconds),
                f"{p.samples_per_second:,.0f}" if p.samples_per_second >= 10 else f"{p.samples_per_second:.3g}",
                f"{p.speedup:.2f}x",
                f"{p.efficiency:.0%}",
                f"{max(p.peak_bytes_per_device) / 2**30:.1f}" + ("" if p.fits else "!"),
                str(p.max_batch_per_device),
            ]
            rows.append(row)
        lines = fitted_table(header, rows, keep=2)
        notes = [
            ("devices: nodes x devices per node; " if self.hardware.nodes > 1 else "")
            + ("" if per_device else "batch/dev: the fullest device's share of the batch; ")
            + f"speedup and eff(iciency): against {reference()} on one device"
            + ("" if per_device else " with the whole batch")
            + "; peak: the fullest device's; max batch: the largest batch per device that fits"
        ]
        if any(not p.fits for p in self.predictions):
            usable = self.hardware.gpu.memory_bytes * self.constants.memory_headroom
            gpu = self.hardware.gpu
            notes.append(
                f"! does not fit in {usable / 2**30:.1f} GiB, the usable part of {gpu.name}'s "
                f"{gpu.memory_bytes / 2**30:.0f} GiB"
            )
        cannot = sorted({p.strategy for p in self.predictions if not p.runs})
        if cannot:
            notes.append(f"* cannot run at precision {self.precision}: {', '.join(cannot)} (no GradScaler)")
        notes += self.compression_notes()
        accumulate = self.meta.get("accumulate", 1)
        if accumulate > 1:
            notes.append(
                f"step: one optimizer step of {accumulate} micro-batches, the gradients exchanged once; samples/s "
                "counts them all"
            )
        return lines + [line for note in notes for line in wrap(note)]

    def compression_notes(self) -> list[str]:
        """What the compress column means, and which strategies were predicted without the compression asked."""
        asked = self.meta.get("compress", "none")
        if asked == "none":
            return []
        declining = sorted({p.strategy for p in self.predictions if p.total_devices > 1 and p.compress != asked})
        warm_up = "; PowerSGD as it runs after its warm-up" if asked.startswith("powersgd") else ""
        note = f"compress: the gradient compression predicted{warm_up}"
        if declining:
            verb = "takes" if len(declining) == 1 else "take"
            note += f"; none: {', '.join(declining)} {verb} no {asked}, predicted uncompressed"
        return [note]

    def phase_lines(self) -> list[str]:
        """The step of each configuration by phase, milliseconds on the slowest device."""
        phases = [name for name in PHASE_ORDER if any(name in p.breakdown for p in self.predictions)]
        header = ["strategy ", "devices"] + [PHASE_HEADERS[name][0] for name in phases]
        rows = [
            [p.label + " ", self._label(p)[1]]  # the trailing space: two between names and figures, as elsewhere
            + [_milliseconds(p.breakdown[name]) if name in p.breakdown else "-" for name in phases]
            for p in self.predictions
        ]
        header = [cell.rjust(5) if i >= 2 else cell for i, cell in enumerate(header)]  # figures apart with gap 1
        lines = ["the step by phase, ms (the slowest device; - : no such phase):"]
        lines += fitted_table(header, rows, keep=2, gap=1)
        legend = ", ".join(f"{PHASE_HEADERS[name][0]} {PHASE_HEADERS[name][1]}" for name in phases)
        return lines + wrap(legend + ".")

    def memory_lines(self) -> list[str]:
        """Each strategy asked, and each variant it plans, on the most devices it uses: the fullest device's memory by
        category, GiB, and what it shards over how many processes."""
        if not self.memory:
            return []
        header = ["strategy", "devices", "shards"] + [column[0] for column in MEMORY_COLUMNS] + ["peak"]
        rows = [
            [row.label, f"{row.nodes}x{row.devices}" if row.nodes > 1 else str(row.devices), row.shards]
            + [_gib(sum(row.bytes_by_category[name] for name in names)) or "-" for _, names, _ in MEMORY_COLUMNS]
            + [_gib(row.peak_bytes)]
            for row in self.memory
        ]
        lines = ["memory per device by category, GiB (the fullest device, on the most devices each uses):"]
        lines += fitted_table(header, rows, keep=1, left=3)
        legend = (
            "shards: what is split (w weights, g gradients, o optimizer state) over how many processes, x the "
            "replicas of each shard; " + "; ".join(f"{header} {words}" for header, _, words in MEMORY_COLUMNS) + "."
        )
        return lines + wrap(legend)

    def recommendation_lines(self) -> list[str]:
        recommendation = self.recommendation
        if recommendation.strategy is None:
            lines = ["recommendation: none (nothing fits; what would:)"]
        else:
            lines = [
                f"recommendation: {recommendation.strategy}"
                + (
                    f" on {recommendation.devices} devices"
                    if recommendation.devices is not None and recommendation.devices > 1
                    else ""
                )
            ]
        for reason in recommendation.reasons:
            lines += wrap(f"  - {reason}", subsequent="    ")
        return lines

    def line_styles(self) -> dict[str, dict[str, Any]]:
        """Per strategy of the figure: its colour, a line style of its own, and a marker and line width that shrink
        from the first strategy to the last, so that equal lines drawn over each other both show."""
        strategies = list(dict.fromkeys(p.strategy for p in self.predictions))
        count = len(strategies)
        colours = _colours(count)
        styles = {}
        for index, strategy in enumerate(strategies):
            shrink = index / max(1, count - 1)  # 0 for the first (drawn first, largest), 1 for the last
            styles[strategy] = {
                "color": colours[index],
                "linestyle": LINE_STYLES[index] if index < len(LINE_STYLES) else (0, (1 + index, 2)),
                "markersize": 11 - 6 * shrink,
                "linewidth": 3.5 - 2.5 * shrink,
            }
        return styles

    def save_png(self, path: str | Path) -> Path:
        """Left: predicted samples/s against devices per strategy, for the configurations that fit (all of them
        when none does), each strategy in a line style of its own, equal lines named in the title; right: the
        step broken into phases, a "!" on the configurations that do not fit."""
        import matplotlib
        from cycler import cycler

        fitting = [p for p in self.predictions if p.fits and p.runs] or self.predictions
        throughput: dict[str, list[tuple[int, float]]] = {}
        for p in fitting:
            throughput.setdefault(p.strategy, []).append((p.total_devices, p.samples_per_second))
        styles = self.line_styles()
        drawn = [strategy for strategy in styles if strategy in throughput]  # the order the figure draws them in
        throughput = {strategy: throughput[strategy] for strategy in drawn}
        # the figure draws a line per strategy with the next style of the axes' cycle
        cycle = cycler(**{key: [styles[strategy][key] for strategy in drawn] for key in LINE_STYLE_KEYS})
        title = f"{self.profile.name} on {self.hardware.gpu.name} / {self.hardware.link.name}"
        equal = equal_lines(throughput)
        if equal:
            title += "\nequal within 1%: " + "; ".join(" = ".join(group) for group in equal)
        with matplotlib.rc_context({"axes.prop_cycle": cycle}):
            return save_scaling_figure(
                path,
                throughput,
                [
                    (f"{p.strategy}\n{p.total_devices}" + ("" if p.fits and p.runs else " !"), p.breakdown)
                    for p in self.predictions
                ],
                PHASE_ORDER,
                title=title,
                throughput_label="samples/s (predicted)",
                phase_label="ms per step (predicted)",
                reference=reference(),
            )


# the phase table's column headers, and their legend
PHASE_HEADERS = {
    "scatter": ("scat", "input scatter from device 0"),
    "replicate": ("repl", "parameter broadcast from device 0"),
    "forward": ("fwd", "forward"),
    "launch": ("lnch", "kernel launches the device waits for"),
    "gather": ("gath", "output gather to device 0"),
    "loss": ("loss", "loss"),
    "backward": ("bwd", "backward"),
    "reduce": ("red", "gradient reduce to device 0"),
    "compress": ("cmpr", "gradient compression's work"),
    "all_reduce": ("a-red", "exposed all-reduce"),
    "all_gather": ("a-gat", "exposed parameter all-gathers"),
    "reduce_scatter": ("r-sct", "exposed gradient reduce-scatter"),
    "optimizer": ("opt", "optimizer step"),
    "overhead": ("other", "Python per step and threads"),
}
LINE_STYLES = ["-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)), (0, (8, 2, 2, 2))]
LINE_STYLE_KEYS = ("color", "linestyle", "markersize", "linewidth")
EQUAL_WITHIN = 0.01  # lines whose every point is this close draw over each other


def _step_milliseconds(seconds: float) -> str:
    """Two decimals below 100 ms: steps that differ by little still differ."""
    ms = seconds * 1e3
    return f"{ms:.2f}" if ms < 100 else f"{ms:.1f}" if ms < 1000 else f"{ms:,.0f}"


def _gib(nbytes: float) -> str:
    """Three significant figures at most, two decimals below 10 GiB: 0.02, 4.89, 16.5, 165 ("" for none)."""
    if nbytes <= 0:
        return ""
    gib = nbytes / 2**30
    return f"{gib:.2f}" if gib < 10 else f"{gib:.1f}" if gib < 100 else f"{gib:,.0f}"


def _milliseconds(seconds: float) -> str:
    """Three significant figures, at most two decimals: 0.02, 4.89, 16.5, 165."""
    ms = seconds * 1e3
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 100 else f"{ms:,.0f}"


def _colours(count: int) -> list[tuple[float, float, float, float]]:
    import matplotlib

    palette = matplotlib.colormaps["tab10" if count <= 10 else "tab20"]
    return [palette(index % palette.N) for index in range(count)]


def equal_lines(throughput: dict[str, list[tuple[int, float]]]) -> list[list[str]]:
    """Groups of strategies whose lines coincide: the same device counts (two or more), every point within 1%."""
    groups: list[list[str]] = []
    for strategy, points in throughput.items():
        counts = dict(points)
        for group in groups:
            other = dict(throughput[group[0]])
            if (
                len(counts) > 1
                and counts.keys() == other.keys()
                and all(abs(counts[n] - other[n]) <= EQUAL_WITHIN * max(counts[n], other[n]) for n in counts)
            ):
                group.append(strategy)
                break
        else:
            groups.append([strategy])
    return [group for group in groups if len(group) > 1]


def make_plan(
    profile: ModelProfile,
    hardware: Hardware,
    strategies: list[str],
    device_counts: list[int],
    batch_per_device: int | BatchSize,
    precision: str = "32",
    constants: CostConstants = CostConstants(),
    optimizer: str = "adam",
    links: Mapping[str, Link] | None = None,
    networks: Mapping[str, Link] | None = None,
    strategy_options: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    compression: str | Compression | None = None,
    accumulate: int = 1,
) -> Plan:
    """Every prediction and the recommendation. A plain number is a batch per device. `links` (the catalogue's)
    and `networks` let the advice re-run the plan with a faster link, among the links the GPU can have
    (`hardware.gpu.links`), and a faster network. `compression`: the gradients' on the link, where a strategy takes
    it (without one, the recommendation says which pays); `accumulate`: micro-batches per optimizer step."""
    batch = as_batch(batch_per_device)
    asked = Reruns(
        profile,
        hardware,
        strategies,
        device_counts,
        batch,
        precision,
        constants,
        optimizer,
        dict(strategy_options or {}),
        dict(links or {}),
        dict(networks or {}),
        parse_compression(compression),
        accumulate,
    )
    predictions = asked.predictions()
    memory = memory_rows(
        profile,
        hardware,
        strategies,
        device_counts,
        batch,
        precision,
        constants,
        optimizer,
        strategy_options,
        asked.compression,
    )
    recommendation = recommend(
        predictions,
        hardware.link.name,
        hardware.network.name if hardware.network else "",
        asked.what_if,
        Sizing(profile, hardware, batch, precision, optimizer, constants),
        asked.payoff,
    )
    add_compression_advice(recommendation, predictions, asked.compression, asked.compressed)
    return Plan(
        profile,
        hardware,
        predictions,
        recommendation,
        constants,
        precision,
        {
            "batch_size": None if batch.per_device else batch.samples,
            "batch_size_per_device": batch.samples if batch.per_device else None,
            "optimizer": optimizer,
            "compress": str(asked.compression),
            "accumulate": accumulate,
        },
        memory,
    )
