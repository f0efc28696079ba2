"""The scaling figure that `dpkit bench` (measured) and `dpkit plan` (predicted) both draw.

Left: samples/s against devices, one line per strategy. Right: one horizontal stacked bar per configuration,
its step broken into phases (milliseconds), the configurations of a strategy together; a label per bar on the
y axis, so that no two labels overlap however many configurations there are. A configuration that does not fit
or cannot run (the planner's predictions) is drawn pale and hatched, and its label and the legend say why.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# a bar's height in inches, and the room the title and the axis take: the figure grows with the bars
BAR_INCHES = 0.22
FRAME_INCHES = 1.6
# how a configuration that does not fit is drawn
UNFIT_STYLE = {"alpha": 0.35, "hatch": "///", "edgecolor": "black", "linewidth": 0.0}


@dataclass(frozen=True)
class PhaseBar:
    """One configuration's bar: its strategy and device count, its step's seconds by phase, whether it fits in the
    devices' memory, and whether the strategy can run it at all (the plan's precision)."""

    strategy: str
    devices: int
    seconds_by_phase: Mapping[str, float]
    fits: bool = True
    runs: bool = True

    @property
    def usable(self) -> bool:
        return self.fits and self.runs

    @property
    def why_not(self) -> str | None:
        """What the legend and the label say of a configuration that is not usable."""
        return None if self.usable else "cannot run" if not self.runs else "does not fit in memory"

    @property
    def label(self) -> str:
        return f"{self.strategy} x{self.devices}" + (f" ({self.why_not})" if self.why_not else "")


def bar_positions(bars: Sequence[PhaseBar]) -> list[float]:
    """Each bar's place on the y axis, top to bottom: one apart, and half a bar more between strategies."""
    positions, place = [], 0.0
    for index, bar in enumerate(bars):
        if index and bar.strategy != bars[index - 1].strategy:
            place += 0.5
        positions.append(place)
        place += 1.0
    return positions


def save_scaling_figure(path: str | os.PathLike, *args: Any, **kwargs: Any) -> Path:
    """The scaling figure (scaling_figure's arguments) written as a PNG at `path`."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure = scaling_figure(*args, **kwargs)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def scaling_figure(
    throughput: Mapping[str, Sequence[tuple[int, float]]],
    bars: Sequence[PhaseBar],
    phases: Sequence[str],
    *,
    title: str,
    throughput_label: str,
    phase_label: str,
    linear_from: float | None = None,
    reference: str | None = None,
) -> Figure:
    """throughput: strategy -> [(devices, samples/s)]; bars: one per configuration, in the order to draw them (top
    to bottom), stacked in the order of `phases`; linear_from: one device's samples/s, drawn as perfect scaling;
    reference: the strategy drawn with squares, the one-device reference the others are measured against."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height = max(4.5, FRAME_INCHES + BAR_INCHES * (len(bars) + len({bar.strategy for bar in bars})))
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, height), gridspec_kw={"width_ratios": [1, 1.15]})
    _draw_throughput(left, throughput, linear_from, reference)
    left.set_xlabel("devices")
    left.set_ylabel(throughput_label)
    left.set_title(title)
    _draw_phase_bars(right, bars, phases, plt.get_cmap("tab20"))
    right.set_xlabel(phase_label)
    figure.tight_layout()
    return figure


def _draw_throughput(
    axes: Any, throughput: Mapping[str, Sequence[tuple[int, float]]], linear_from: float | None, reference: str | None
) -> None:
    counts: set[int] = set()
    for strategy, points in throughput.items():
        points = sorted(points)
        counts.update(d for d, _ in points)
        axes.plot(
            [d for d, _ in points], [s for _, s in points], marker="s" if strategy == reference else "o", label=strategy
        )
    if linear_from is not None and counts:
        ticks = sorted(counts)
        axes.plot(ticks, [linear_from * n for n in ticks], linestyle=":", color="grey", label="linear from one device")
    axes.set_xticks(sorted(counts))
    axes.legend(fontsize="small")


def _draw_phase_bars(axes: Any, bars: Sequence[PhaseBar], phases: Sequence[str], colours: Any) -> None:
    """Horizontal stacked bars, the first configuration on top; pale and hatched where it does not fit."""
    from matplotlib.patches import Patch

    positions = bar_positions(bars)
    lefts = [0.0] * len(bars)
    for index, phase in enumerate(phases):
        widths = [bar.seconds_by_phase.get(phase, 0.0) * 1e3 for bar in bars]
        if not any(widths):
            continue
        colour = colours(index % colours.N)  # more phases than the default cycle's 10 colours: none repeats
        fitting = [i for i, bar in enumerate(bars) if bar.usable]
        unfit = [i for i, bar in enumerate(bars) if not bar.usable]
        for chosen, style in ((fitting, {}), (unfit, UNFIT_STYLE)):
            if chosen:
                axes.barh(
                    [positions[i] for i in chosen],
                    [widths[i] for i in chosen],
                    left=[lefts[i] for i in chosen],
                    color=colour,
                    label=phase if chosen is fitting or not fitting else None,
                    **style,
                )
        lefts = [start + width for start, width in zip(lefts, widths)]
    axes.set_yticks(positions, [bar.label for bar in bars], fontsize="small")
    for tick, bar in zip(axes.get_yticklabels(), bars):
        if not bar.usable:
            tick.set_color("dimgrey")
    axes.invert_yaxis()  # the first configuration on top, as in the tables
    handles, labels = axes.get_legend_handles_labels()
    for reason in dict.fromkeys(bar.why_not for bar in bars if bar.why_not):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///"))
        labels.append(f"hatched: {reason}")
    axes.legend(handles, labels, fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
