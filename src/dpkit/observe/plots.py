"""The scaling figure that `dpkit bench` (measured) and `dpkit plan` (predicted) both draw.

Left: samples/s against devices, one line per strategy. Right: one stacked bar per configuration,
its step broken into phases (milliseconds).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path


def save_scaling_figure(
    path: str | os.PathLike,
    throughput: Mapping[str, Sequence[tuple[int, float]]],
    bars: Sequence[tuple[str, Mapping[str, float]]],
    phases: Sequence[str],
    *,
    title: str,
    throughput_label: str,
    phase_label: str,
    linear_from: float | None = None,
    reference: str | None = None,
) -> Path:
    """throughput: strategy -> [(devices, samples/s)]; bars: (label, {phase: seconds}) per configuration,
    stacked in the order of `phases`; linear_from: one device's samples/s, drawn as perfect scaling;
    reference: the strategy drawn with squares, the one-device reference the others are measured against."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    counts: set[int] = set()
    for strategy, points in throughput.items():
        points = sorted(points)
        counts.update(d for d, _ in points)
        left.plot(
            [d for d, _ in points], [s for _, s in points], marker="s" if strategy == reference else "o", label=strategy
        )
    if linear_from is not None and counts:
        ticks = sorted(counts)
        left.plot(ticks, [linear_from * n for n in ticks], linestyle=":", color="grey", label="linear from one device")
    left.set_xticks(sorted(counts))
    left.set_xlabel("devices")
    left.set_ylabel(throughput_label)
    left.set_title(title)
    left.legend(fontsize="small")
    labels = [label for label, _ in bars]
    bottoms = [0.0] * len(labels)
    colours = plt.get_cmap("tab20")  # more phases than the default cycle's 10 colours: none repeats
    for index, phase in enumerate(phases):
        heights = [seconds.get(phase, 0.0) * 1e3 for _, seconds in bars]
        if any(heights):
            right.bar(labels, heights, bottom=bottoms, label=phase, color=colours(index % colours.N))
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    right.set_ylabel(phase_label)
    right.tick_params(axis="x", labelsize="x-small", labelrotation=60)
    right.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
