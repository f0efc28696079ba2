"""Several reports side by side (`dpkit profile --strategies dp,ddp`): one table with a column pair per report,
each device's peak memory and the time of its phases, and a figure with a column per report, memory by
category above and time by phase below, on shared axes so that the bars compare at a glance."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpkit.observe.memory import CATEGORIES
from dpkit.observe.report import Report, aligned_columns
from dpkit.observe.timing import PHASES

MIB = 1024 * 1024

TABLE_NOTE = (
    "peak MiB: the device's peak memory; ms: the time of its phases per observed step (memory accounted); "
    "imbalance: max/mean of the peaks; step: the wall-clock step, timed again without memory accounting"
)


def step_seconds(report: Report) -> float | None:
    """The wall-clock time of a step (rank 0's under a process per device); None where it was not timed."""
    return report.threads["step_seconds"] if report.threads else None


def phase_seconds_per_step(report: Report, device: str) -> float:
    """The time of one device's phases, summed, per observed step."""
    return sum(report.device(device).seconds_by_phase.values()) / max(report.steps, 1)


def side_by_side_table(reports: Sequence[Report], names: Sequence[str]) -> str:
    """A row per device (every device any report has, in order of appearance), a column pair per report: its peak
    MiB and ms; then each report's imbalance and step; a "-" where a report has no such device."""
    devices = list(dict.fromkeys(d.device for report in reports for d in report.devices))
    rows = [["device"] + [f"{name} {column}" for name in names for column in ("peak MiB", "ms")]]
    for device in devices:
        row = [device]
        for report in reports:
            if any(d.device == device for d in report.devices):
                row += [
                    f"{report.device(device).peak_bytes / MIB:.2f}",
                    f"{phase_seconds_per_step(report, device) * 1e3:.2f}",
                ]
            else:
                row += ["-", "-"]
        rows.append(row)
    rows.append(["imbalance"] + [cell for report in reports for cell in (f"{report.imbalance:.2f}", "")])
    steps = [step_seconds(report) for report in reports]
    rows.append(["step"] + [cell for step in steps for cell in ("", "-" if step is None else f"{step * 1e3:.2f}")])
    return "\n".join([*(line.rstrip() for line in aligned_columns(rows)), *textwrap.wrap(TABLE_NOTE, width=110)])


def save_side_by_side_png(reports: Sequence[Report], names: Sequence[str], path: str | Path, title: str) -> Path:
    """A column per report: above, a stacked bar per device of its memory by category at the device's peak (MiB);
    below, a stacked bar per device of its time by phase (ms per step). Each row shares its axis, and a category or
    phase has one colour in every column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(2, len(reports), figsize=(2.2 + 2.6 * len(reports), 7.0), sharey="row", squeeze=False)
    # a colour per category (10 enough) and per phase (more than 10: tab20's), the same in every column
    category_colours, phase_colours = plt.get_cmap("tab10"), plt.get_cmap("tab20")
    for column, (report, name) in enumerate(zip(reports, names)):
        memory, time = axes[0][column], axes[1][column]
        devices = [d.device for d in report.devices]
        per_step = 1e3 / max(report.steps, 1)
        megabytes = [[d.bytes_by_category.get(c, 0) / MIB for d in report.devices] for c in CATEGORIES]
        _stacked(memory, devices, megabytes, CATEGORIES, [category_colours(i) for i in range(len(CATEGORIES))])
        milliseconds = [[d.seconds_by_phase.get(p, 0.0) * per_step for d in report.devices] for p in PHASES]
        _stacked(time, devices, milliseconds, PHASES, [phase_colours(i) for i in range(len(PHASES))])
        step = step_seconds(report)
        memory.set_title(f"{name}\nimbalance {report.imbalance:.2f}", fontsize="medium")
        time.set_title(f"{name}: step {step * 1e3:.2f} ms" if step is not None else name, fontsize="medium")
    axes[0][0].set_ylabel("MiB at the device's peak")
    axes[1][0].set_ylabel("ms per step, by phase")
    for row, order in zip(axes, (CATEGORIES, PHASES)):
        _legend_beside(row, order)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _stacked(
    axes: Any, devices: list[str], heights: list[list[float]], labels: Sequence[str], colours: list[Any]
) -> None:
    """One stacked bar per device: a layer per label whose heights are not all zero, in the label's colour."""
    bottoms = [0.0] * len(devices)
    for layer, label, colour in zip(heights, labels, colours):
        if any(layer):
            axes.bar(devices, layer, bottom=bottoms, label=label, color=colour)
            bottoms = [b + h for b, h in zip(bottoms, layer)]


def _legend_beside(row: Sequence[Any], order: Sequence[str]) -> None:
    """One legend per row, right of its last column, naming every layer any column drew, once, in `order`."""
    entries: dict[str, Any] = {}
    for axes in row:
        for handle, label in zip(*axes.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    labels = [label for label in order if label in entries]
    row[-1].legend(
        [entries[label] for label in labels], labels, fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0)
    )
