"""When no strategy fits or runs: the recommendation names none, and its reasons say what would fit. The
lightest sharding that fits on the fewest devices (or, when none does on any count, the one holding the least), on
how many devices it fits, CPU offload of its shards, and the largest batch per device that fits; `would_fit` in
the plan's JSON."""

from __future__ import annotations

from typing import Any

from dpkit.plan.advice_words import devices_words, gib, shards_words
from dpkit.plan.configuration import runs_at
from dpkit.plan.cost_model import Prediction
from dpkit.plan.lightest_sharding import lightest_sharding
from dpkit.plan.memory import Sizing
from dpkit.strategies import matching, strategy_class


def nothing_fits(predictions: list[Prediction], sizing: Sizing | None) -> tuple[list[str], dict[str, Any] | None]:
    """(reasons, would_fit) when no strategy fits (or runs): the least memory asked, and what would fit (None:
    nothing to suggest beyond sharding, a smaller batch or a larger device)."""
    candidates = [p for p in predictions if p.runs] or predictions
    smallest = min(candidates, key=lambda p: max(p.peak_bytes_per_device))
    largest = max(p.devices for p in predictions)
    nodes = max(p.nodes for p in predictions)
    first = (
        f"nothing fits: the least memory is {smallest.strategy} on {devices_words(smallest.devices, smallest.nodes)}"
    )
    reasons = [first + "".join(f"; {note}" for note in smallest.notes)]
    shard = sharding_to_suggest(sizing, largest) if sizing is not None else None
    if sizing is None or shard is None:
        batch = max(p.max_batch_per_device for p in candidates)
        reasons.append(
            "shard the model (FSDP / ZeRO), use a smaller batch"
            + (f" (up to {batch} per device)" if batch else "")
            + ", or a larger device"
        )
        return reasons, None
    more, would_fit = _what_would_fit(predictions, sizing, shard, largest, nodes)
    return reasons + more, would_fit


def _what_would_fit(
    predictions: list[Prediction], sizing: Sizing, shard: str, largest: int, nodes: int
) -> tuple[list[str], dict[str, Any]]:
    """(reasons, would_fit) for the sharded strategy to suggest: on how many devices it fits, or that none does;
    CPU offload of its shards (on GPUs); the largest batch per device that fits on `largest` devices per node."""
    notes = []
    if not any(p.strategy == shard for p in predictions):
        notes.append("not among the strategies asked")
    if not runs_at(shard, sizing.precision):
        notes.append("with precision bf16-mixed: it has no GradScaler for 16-mixed")
    also = f" ({'; '.join(notes)})" if notes else ""
    reasons = []
    would_fit: dict[str, Any] = {"strategy": shard}
    devices = sizing.smallest_fitting_devices(shard)
    would_fit["devices"] = devices * nodes if devices is not None else None
    if devices is not None:
        reasons.append(
            f"more devices: {shard} shards {shards_words(shard)} and fits on "
            f"{devices_words(devices, nodes)}, {gib(sizing.peak_bytes(shard, devices))} each{also}"
        )
    else:
        floor = sizing.peak_bytes(shard, 1, offload=True)
        activations = floor - sizing.peak_bytes(shard, 1, offload=True, batch=0)
        reasons.append(
            f"more devices: no device count makes {shard} fit: what it gathers and the activations alone "
            f"need {gib(floor)} of the {gib(sizing.usable_bytes)} usable, {gib(activations)} of it "
            f"activations and outputs (shorter inputs would shrink them){also}"
        )
    if not sizing.hardware.shared_compute:
        offloaded = sizing.peak_bytes(shard, largest, offload=True)
        would_fit["offload"] = offloaded <= sizing.usable_bytes
        host = (sizing.peak_bytes(shard, largest) - offloaded) * largest
        reasons.append(
            f"CPU offload ({shard} with its shards in host memory, about {gib(host)} of host memory per node): "
            f"{gib(offloaded)} per device on {devices_words(largest, nodes)}, "
            + ("which fits" if would_fit["offload"] else "which does not fit either")
        )
    batch = sizing.largest_batch(shard, largest)
    would_fit["batch_size_per_device"] = batch or None
    if batch >= sizing.share(largest):
        reasons.append(f"{shard} fits the batch asked on {devices_words(largest, nodes)}{also}")
    elif batch > 0:
        reasons.append(f"a smaller batch: {shard} on {devices_words(largest, nodes)} fits {batch} per device")
    else:
        reasons.append(f"a smaller batch: not even 1 sample per device fits {shard} on {devices_words(largest, nodes)}")
    return reasons, would_fit


def sharding_to_suggest(sizing: Sizing, devices: int) -> str | None:
    """The sharded strategy to suggest when nothing fits: the lightest sharding that fits on the fewest devices,
    else (none fits on any count) the one holding the least on `devices` devices per node."""
    names = matching(lambda traits: traits.sharded)
    if not names:
        return None
    fitting = [(count, name) for name in names if (count := sizing.smallest_fitting_devices(name)) is not None]
    if fitting:
        fewest = min(count for count, _ in fitting)
        return min(
            (name for count, name in fitting if count == fewest),
            key=lambda name: lightest_sharding(strategy_class(name).traits, fewest * sizing.hardware.nodes, fewest),
        )
    return min(names, key=lambda name: sizing.peak_bytes(name, devices))
