"""From predictions to advice: which strategy, why, what limits it, and what would change the answer.

The advice is about DataParallel: is it fine here, or what does a process per device buy? And when the
model does not fit a device whole, about sharding it: the lightest sharding that fits (fewest parts of the state
sharded, then the smallest shard group), a more sharded one only where it is clearly faster. The advisor finds
the strategies it speaks of by their traits (dpkit.strategies), never by name nor by the registry's order, and
among strategies alike takes the fastest. It never recommends a configuration that does not
fit in memory or cannot run at the precision asked: when none can, the recommendation names no strategy
(`strategy` None, JSON null) and its reasons say what would fit (would_fit.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpkit.plan.advice_words import PHASE_WORDS, devices_words, gib, milliseconds, phase_words, shards_words
from dpkit.plan.cost_model import Prediction
from dpkit.plan.lightest_sharding import lightest_sharding, lightest_worthwhile
from dpkit.plan.memory import Sizing
from dpkit.plan.would_fit import nothing_fits
from dpkit.strategies import ON_ROOT, ONE_PROCESS, PER_DEVICE, PER_STEP, Traits, reference, strategy_class

COMMUNICATION = ("scatter", "replicate", "gather", "reduce", "all_reduce", "all_gather", "reduce_scatter")
DP_FINE_RATIO = 0.9  # DP is fine when it reaches this share of the best throughput
HELPS_SPEEDUP = 1.1  # below this, more devices do not help
LAUNCH_BOUND_SHARE = 0.5  # a step whose launches and per-step Python are this share of it is launch-bound


@dataclass
class Recommendation:
    """A strategy and its devices (in all, across nodes), or, when nothing fits, no strategy (None) and no
    devices; then `would_fit` says what would: the sharded strategy's device count, CPU offload, a batch.
    `compress`: the gradient compression it names (compression_advice.py), None where none pays or applies."""

    strategy: str | None
    devices: int | None
    reasons: list[str] = field(default_factory=list)
    would_fit: dict[str, Any] | None = None
    compress: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "devices": self.devices,
            "compress": self.compress,
            "reasons": list(self.reasons),
            "would_fit": dict(self.would_fit) if self.would_fit is not None else None,
        }


def is_data_parallel(traits: Traits) -> bool:
    """torch's DataParallel as the lesson teaches it: one process, replicas copied from device 0 at every step,
    the loss on device 0, no balancing (dp)."""
    return (
        traits.processes == ONE_PROCESS
        and traits.replicas == PER_STEP
        and traits.loss == ON_ROOT
        and not traits.balances
    )


def data_parallel(predictions: Sequence[Prediction]) -> str | None:
    """The DataParallel the advice speaks of: of the predictions' strategies with its traits, the fastest."""
    candidates = [p for p in predictions if is_data_parallel(strategy_class(p.strategy).traits)]
    return max(candidates, key=lambda p: p.samples_per_second).strategy if candidates else None


def prediction_sharding(prediction: Prediction) -> tuple[int, int]:
    """lightest_sharding of the prediction's strategy on its devices."""
    traits = strategy_class(prediction.strategy).traits_for(**prediction.options)
    return lightest_sharding(traits, prediction.total_devices, prediction.devices)


def shards(strategy: str) -> bool:
    return strategy_class(strategy).traits.sharded


def usable(prediction: Prediction) -> bool:
    """Fits in memory and runs at the precision asked: the only predictions the advisor may recommend."""
    return prediction.fits and prediction.runs


def _losses(prediction: Prediction) -> str:
    """The phases that grew beyond the one-device step, largest first."""
    parts = sorted(
        ((seconds, name) for name, seconds in prediction.breakdown.items() if name not in ("forward", "backward")),
        reverse=True,
    )
    step = prediction.step_seconds
    words = phase_words(prediction.strategy)
    return ", ".join(
        f"{words.get(name, name)} {seconds / step:.0%}" for seconds, name in parts[:3] if seconds / step >= 0.01
    )


def launch_share(prediction: Prediction) -> float:
    """The share of a step that goes to launching kernels and the per-step Python around them."""
    host = prediction.breakdown.get("launch", 0.0) + prediction.breakdown.get("overhead", 0.0)
    return host / prediction.step_seconds if prediction.step_seconds > 0 else 0.0


# payoff(strategy, devices per node) -> from which batch the strategy outruns one device, in words (or None)
Payoff = Callable[[str, int], str | None]

# what_if(change, devices per node) -> (the change in words, the plan re-run with it), or None where the change
# does not apply ("faster-link": the fastest link the GPU can have that joins that many devices)
WhatIf = Callable[[str, int], tuple[str, list[Prediction]] | None]
CHANGES = ("faster-link", "faster-network", "double-batch")


def recommend(
    predictions: list[Prediction],
    link_name: str = "",
    network_name: str = "",
    what_if: WhatIf | None = None,
    sizing: Sizing | None = None,
    payoff: Payoff | None = None,
) -> Recommendation:
    """`what_if(change, devices)` may re-run the plan with each of CHANGES for the last reasons;
    `sizing` answers what the predictions do not when little or nothing fits (on how many devices the
    sharded strategy fits, CPU offload, a smaller batch); `payoff(strategy, devices)` gives the batch from which
    a strategy on that many devices outruns one device, in words (plan/payoff.py), for when DP does not."""
    fits = [p for p in predictions if usable(p)]
    if not fits:
        reasons, would_fit = nothing_fits(predictions, sizing)
        return Recommendation(None, None, reasons, would_fit)
    multi = [p for p in fits if p.total_devices > 1]
    if not multi:
        alone = next((p for p in fits if p.strategy == reference()), fits[0])
        return Recommendation(alone.strategy, 1, ["only one device was asked for (or fits): nothing to compare"])
    largest = max(p.total_devices for p in multi)
    at_largest = [p for p in multi if p.total_devices == largest]
    if all(shards(p.strategy) for p in fits):
        return _only_sharded_fits(predictions, fits, at_largest, link_name, network_name, sizing)
    dp_name = data_parallel(fits)
    worthwhile = lightest_worthwhile(at_largest, prediction_sharding, lambda p: 1 / p.samples_per_second)
    best = max(worthwhile, key=lambda p: p.samples_per_second)
    choice = _choose(fits, at_largest, best, dp_name)
    choice.reasons += _where_dp_stops_scaling(multi, dp_name, payoff)
    sharding = _why_this_sharding(at_largest, best)
    if sharding is not None and sharding[0] == choice.strategy:
        choice.reasons.insert(1, sharding[1])
    chosen = next((p for p in at_largest if p.strategy == choice.strategy), best)
    choice.reasons += _limits(chosen, link_name, network_name)
    choice.reasons += _what_would_change(what_if, largest, chosen.devices, dp_name)
    return choice


def _choose(
    fits: list[Prediction], at_largest: list[Prediction], best: Prediction, dp_name: str | None
) -> Recommendation:
    """One device when no strategy reaches HELPS_SPEEDUP; DP when it is within DP_FINE_RATIO of the best (no
    processes to launch); else the best, with what DP loses and what its successor would give. `best`: the fastest
    of the lightest sharding worth it on the largest device count."""
    one_device = reference()
    largest = best.total_devices
    alone = next((p for p in fits if p.strategy == one_device and p.total_devices == 1), None)
    dp = next((p for p in at_largest if p.strategy == dp_name), None)
    if best.speedup < HELPS_SPEEDUP and alone is not None:
        return Recommendation(one_device, 1, [_neither_helps(alone, best)])
    if dp is not None and dp.samples_per_second >= DP_FINE_RATIO * best.samples_per_second:
        return Recommendation(
            dp.strategy,
            largest,
            [
                f"DP is fine here: {dp.speedup:.2f}x ({dp.efficiency:.0%}) on {largest} devices, within "
                f"{1 - dp.samples_per_second / best.samples_per_second:.0%} of the best ({best.strategy}), "
                "with no processes to launch"
            ],
        )
    reasons = [
        f"{best.strategy} on {largest} devices: {best.speedup:.2f}x one device ({best.efficiency:.0%} efficiency)"
        + ("" if alone is not None else f" (one device cannot hold the {one_device} step; its time is the yardstick)")
    ]
    if dp is not None:
        reasons.append(f"DP reaches only {dp.speedup:.2f}x ({dp.efficiency:.0%}): it loses {_losses(dp)}")
        ddp = _dp_successor(at_largest)
        if ddp is not None and best is not ddp:
            reasons.append(f"{ddp.strategy} would give {ddp.speedup:.2f}x")
    return Recommendation(best.strategy, largest, reasons)


def _dp_successor(at_largest: list[Prediction]) -> Prediction | None:
    """DataParallel's recommended successor: a process per device, nothing sharded (ddp), the fastest such."""
    return max(
        (p for p in at_largest if strategy_class(p.strategy).traits.processes == PER_DEVICE and not shards(p.strategy)),
        key=lambda p: p.samples_per_second,
        default=None,
    )


def _neither_helps(alone: Prediction, best: Prediction) -> str:
    """Why one device: a step that is mostly launches and per-step Python, or what communication costs the best."""
    share = launch_share(alone)
    if share >= LAUNCH_BOUND_SHARE:
        return (
            f"neither helps: on this model a step is mostly operation launches and per-step Python ({share:.0%} "
            f"of one device's step), which more devices do not divide; the best, {best.strategy} on "
            f"{best.total_devices} devices, reaches {best.speedup:.2f}x one device ({_losses(best)})"
        )
    return (
        f"neither helps: the best, {best.strategy} on {best.total_devices} devices, reaches {best.speedup:.2f}x one "
        f"device (communication dominates: {_losses(best)})"
    )


def _where_dp_stops_scaling(multi: list[Prediction], dp_name: str | None, payoff: Payoff | None) -> list[str]:
    """Where DP is slower than one device from the start (and from which batch it would pay), or the largest
    count at which adding devices still adds throughput."""
    dp_runs = sorted((p for p in multi if p.strategy == dp_name), key=lambda p: p.total_devices)
    if dp_runs and dp_runs[0].speedup < 1.0:
        pays = payoff(dp_runs[0].strategy, dp_runs[0].devices) if payoff is not None else None
        return [
            f"DP is slower than one device already on {dp_runs[0].total_devices} ({dp_runs[0].speedup:.2f}x)"
            + (f"; {pays}" if pays else "")
        ]
    for before, after in zip(dp_runs, dp_runs[1:]):
        if after.samples_per_second <= before.samples_per_second * 1.05:
            return [
                f"DP stops scaling after {before.total_devices} devices "
                f"({before.speedup:.2f}x, then {after.speedup:.2f}x)"
            ]
    return []


def _why_this_sharding(at_largest: list[Prediction], best: Prediction) -> tuple[str, str] | None:
    """(the strategy it speaks for, why sharding is or is not the answer): a faster, more sharded strategy not worth
    it, or a sharded best that is worth it over the best whole copy per device; None when sharding is no question."""
    fastest = max(at_largest, key=lambda p: p.samples_per_second)
    if best is not fastest and shards(fastest.strategy):
        faster = fastest.samples_per_second / best.samples_per_second - 1
        if shards(best.strategy):
            why = f"too little for more sharding: {best.strategy} shards only {shards_words(best.strategy)}"
        else:
            why = (
                f"too little for sharding: {best.strategy} keeps a whole model on each device, "
                "with no parameters to gather"
            )
        return best.strategy, f"{fastest.strategy} would be {faster:.1%} faster, {why}"
    best_whole = max(
        (p for p in at_largest if not shards(p.strategy)), key=lambda p: p.samples_per_second, default=None
    )
    if shards(best.strategy) and best_whole is not None:
        faster = best.samples_per_second / best_whole.samples_per_second - 1
        why = why_faster(best, best_whole)
        return best.strategy, f"{best.strategy} is {faster:.0%} faster than {best_whole.strategy}" + (
            f": {why}" if why else ""
        )
    return None


def deciding_term(faster: Prediction, slower: Prediction) -> tuple[str, float, float] | None:
    """The phase that decides between two configurations: the one in which `faster` saves the most time over
    `slower`, with its seconds in each; None when it saves in none."""
    names = set(faster.breakdown) | set(slower.breakdown)
    saving = {name: slower.breakdown.get(name, 0.0) - faster.breakdown.get(name, 0.0) for name in names}
    name = max(sorted(saving), key=lambda phase: saving[phase], default=None)
    if name is None or saving[name] <= 0:
        return None
    return name, faster.breakdown.get(name, 0.0), slower.breakdown.get(name, 0.0)


def why_faster(faster: Prediction, slower: Prediction) -> str:
    """Why `faster` (a sharded strategy) beats `slower` (a whole copy per device), citing the deciding term with
    its figures from the phase table, and what in the traits makes it so where the advice knows."""
    term = deciding_term(faster, slower)
    if term is None:
        return ""
    name, ours, theirs = term
    figures = f"{milliseconds(ours)} against {slower.strategy}'s {milliseconds(theirs)}"
    if name == "optimizer":
        return f"each device steps only its shard of the optimizer state (the optimizer step {figures})"
    words = phase_words(faster.strategy).get(name, name)
    text = f"its {words} take{'' if words.endswith('s') else 's'} {figures}"
    traits = strategy_class(faster.strategy).traits_for(**faster.options)
    replicas = faster.total_devices // max(1, traits.shard_size(faster.total_devices, faster.devices))
    if name == "all_reduce" and traits.sharded and replicas > 1:
        text += (
            f": it all-reduces each shard among its {replicas} replicas, {slower.strategy} the whole gradient among "
            f"all {slower.total_devices} processes"
        )
    return text


def _limits(chosen: Prediction, link_name: str, network_name: str) -> list[str]:
    """The bottleneck link and host-bound launches of the chosen configuration."""
    reasons = []
    communication = {name: seconds for name, seconds in chosen.breakdown.items() if name in COMMUNICATION}
    if communication:
        name, seconds = max(communication.items(), key=lambda item: item[1])
        collective = name in ("all_reduce", "all_gather", "reduce_scatter")  # what crosses nodes
        bound = network_name if (collective and chosen.nodes > 1 and network_name) else link_name
        reasons.append(
            f"bottleneck link: {bound or 'the device link'} carries the {PHASE_WORDS[name]}, "
            f"{seconds * 1e3:.2f} ms of the {chosen.step_seconds * 1e3:.2f} ms step "
            f"({seconds / chosen.step_seconds:.0%})"
        )
    if chosen.breakdown.get("launch", 0) > 0.05 * chosen.step_seconds:
        reasons.append(
            f"host-bound: kernel launches take {chosen.breakdown['launch'] / chosen.step_seconds:.0%} of the step; "
            "a larger batch per device, CUDA graphs or torch.compile would hide them"
        )
    return reasons


def _what_would_change(what_if: WhatIf | None, largest: int, per_node: int, dp_name: str | None) -> list[str]:
    """The plan re-run with the fastest link the GPU can have, the fastest network, twice the batch: the best
    that fits on `largest` devices in all (`per_node` per node), each change named."""
    reasons: list[str] = []
    if what_if is None:
        return reasons
    for change in CHANGES:
        answer = what_if(change, per_node)
        if answer is None:
            continue
        words, predictions = answer
        changed = [p for p in predictions if usable(p) and p.total_devices == largest]
        if not changed:
            continue
        best_changed = max(changed, key=lambda p: p.samples_per_second)
        dp_changed = next((p for p in changed if p.strategy == dp_name), None)
        text = f"with {words}: best {best_changed.strategy} {best_changed.speedup:.2f}x"
        if dp_changed is not None:
            text += f", {dp_changed.strategy} {dp_changed.speedup:.2f}x"
        reasons.append("what would change the answer: " + text)
    return reasons


def _only_sharded_fits(
    predictions: list[Prediction],
    fits: list[Prediction],
    at_largest: list[Prediction],
    link_name: str,
    network_name: str,
    sizing: Sizing | None,
) -> Recommendation:
    """Only strategies that shard fit: recommend the lightest sharding that fits (a more sharded one where it is
    clearly faster) on the largest device count asked (more devices, more throughput, and less memory each), and
    say from how many devices it fits."""
    worthwhile = lightest_worthwhile(at_largest, prediction_sharding, lambda p: 1 / p.samples_per_second)
    best = max(worthwhile, key=lambda p: p.samples_per_second)
    name, count, nodes = best.strategy, best.total_devices, best.nodes
    fitting_counts = sorted({p.devices for p in fits if p.strategy == name})
    smallest = sizing.smallest_fitting_devices(name) if sizing is not None else None
    if smallest is None:
        smallest = fitting_counts[0]
    unsharded = [p for p in predictions if not shards(p.strategy) and p.runs]
    others = sorted({p.strategy for p in fits} - {name})
    reasons = [
        f"only {name}{' and ' + ', '.join(others) if others else ''} fit{'' if others else 's'}: "
        f"{'it' if not others else name} shards {shards_words(name)} over the devices, "
        f"{gib(max(best.peak_bytes_per_device))} per device on {count} devices"
        + (", the lightest sharding that fits" if others else "")
        + (
            f"; the others need at least {gib(min(max(p.peak_bytes_per_device) for p in unsharded))}"
            if unsharded
            else ""
        ),
        f"{name} fits from {devices_words(smallest, nodes)} on; recommended on {count} devices, the most asked "
        f"({best.samples_per_second:,.1f} samples/s)",
    ]
    reasons += _limits(best, link_name, network_name)
    return Recommendation(name, count, reasons)
