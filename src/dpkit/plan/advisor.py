"""From predictions to advice: which strategy, why, what limits it, and what would change the answer.

The advice is about DataParallel: is it fine here, or what does a process per device buy? The advisor
finds the strategies it speaks of by their traits in the registry (dpkit.strategies), not by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dpkit.plan.cost_model import Prediction
from dpkit.strategies import ON_ROOT, ONE_PROCESS, PER_DEVICE, PER_STEP, Traits, matching, reference

COMMUNICATION = ("scatter", "replicate", "gather", "reduce", "all_reduce")
PHASE_WORDS = {
    "scatter": "input scatter",
    "replicate": "per-step parameter broadcast",
    "gather": "output gather",
    "loss": "loss on device 0",
    "reduce": "gradient reduce to device 0",
    "all_reduce": "exposed all-reduce",
    "launch": "GIL-serialised kernel launches",
    "overhead": "per-step Python and threads",
    "optimizer": "optimizer step",
    "forward": "forward",
    "backward": "backward",
}
DP_FINE_RATIO = 0.9  # DP is fine when it reaches this share of the best throughput
HELPS_SPEEDUP = 1.1  # below this, more devices do not help


@dataclass
class Recommendation:
    strategy: str
    devices: int
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "devices": self.devices, "reasons": list(self.reasons)}


def _first_matching(predicate: Callable[[Traits], bool]) -> str | None:
    return next(iter(matching(predicate)), None)


def data_parallel() -> str | None:
    """The strategy that is torch's DataParallel as the lesson teaches it: one process, replicas copied
    from device 0 at every step, the loss on device 0, no balancing (dp)."""
    return _first_matching(
        lambda traits: (
            traits.processes == ONE_PROCESS
            and traits.replicas == PER_STEP
            and traits.loss == ON_ROOT
            and not traits.balances
        )
    )


def process_per_device() -> str | None:
    """The unsharded strategy with one process per device, DataParallel's recommended successor (ddp)."""
    return _first_matching(lambda traits: traits.processes == PER_DEVICE and not traits.sharded)


def _losses(prediction: Prediction) -> str:
    """The phases that grew beyond the one-device step, largest first."""
    parts = sorted(
        ((seconds, name) for name, seconds in prediction.breakdown.items() if name not in ("forward", "backward")),
        reverse=True,
    )
    step = prediction.step_seconds
    return ", ".join(
        f"{PHASE_WORDS.get(name, name)} {seconds / step:.0%}" for seconds, name in parts[:3] if seconds / step >= 0.01
    )


def recommend(
    predictions: list[Prediction],
    link_name: str = "",
    network_name: str = "",
    what_if: Callable[[str], list[Prediction]] | None = None,
) -> Recommendation:
    """`what_if(change)` may re-run the plan with "faster-link" or "double-batch" for the last reason."""
    one_device = reference()
    dp_name, ddp_name = data_parallel(), process_per_device()
    fits = [p for p in predictions if not any("does not fit" in n for n in p.notes)]
    multi = [p for p in fits if p.total_devices > 1]
    if not fits:
        smallest = min(predictions, key=lambda p: max(p.peak_bytes_per_device))
        return Recommendation(
            smallest.strategy,
            smallest.total_devices,
            [
                f"nothing fits: {smallest.notes[0]}; "
                "every strategy here keeps a whole model, its gradients and optimizer "
                "state on each device, so shard them (FSDP / ZeRO), use a smaller batch, or a larger device"
            ],
        )
    if not multi:
        return Recommendation(one_device, 1, ["only one device was asked for (or fits): nothing to compare"])
    largest = max(p.total_devices for p in multi)
    at_largest = [p for p in multi if p.total_devices == largest]
    best = max(at_largest, key=lambda p: p.samples_per_second)
    dp = next((p for p in at_largest if p.strategy == dp_name), None)
    ddp = next((p for p in at_largest if p.strategy == ddp_name), None)
    reasons: list[str] = []

    if best.speedup < HELPS_SPEEDUP:
        choice = Recommendation(one_device, 1)
        reasons.append(
            f"neither helps: the best, {best.strategy} on {largest} devices, reaches {best.speedup:.2f}x one device "
            f"(communication dominates: {_losses(best)})"
        )
    elif dp is not None and dp.samples_per_second >= DP_FINE_RATIO * best.samples_per_second:
        choice = Recommendation(dp.strategy, largest)
        reasons.append(
            f"DP is fine here: {dp.speedup:.2f}x ({dp.efficiency:.0%}) on {largest} devices, within "
            f"{1 - dp.samples_per_second / best.samples_per_second:.0%} of the best ({best.strategy}), "
            "with no processes to launch"
        )
    else:
        choice = Recommendation(best.strategy, largest)
        reasons.append(
            f"{best.strategy} on {largest} devices: {best.speedup:.2f}x one device ({best.efficiency:.0%} efficiency)"
        )
        if dp is not None:
            reasons.append(f"DP reaches only {dp.speedup:.2f}x ({dp.efficiency:.0%}): it loses {_losses(dp)}")
            if ddp is not None and best.strategy != ddp.strategy:
                reasons.append(f"{ddp.strategy} would give {ddp.speedup:.2f}x")
    # where DP stops scaling: the largest count at which adding devices still adds throughput
    dp_runs = sorted((p for p in multi if p.strategy == dp_name), key=lambda p: p.total_devices)
    if dp_runs and dp_runs[0].speedup < 1.0:
        reasons.append(
            f"DP is slower than one device already on {dp_runs[0].total_devices} ({dp_runs[0].speedup:.2f}x)"
        )
        dp_runs = []
    for before, after in zip(dp_runs, dp_runs[1:]):
        if after.samples_per_second <= before.samples_per_second * 1.05:
            reasons.append(
                f"DP stops scaling after {before.total_devices} devices "
                f"({before.speedup:.2f}x, then {after.speedup:.2f}x)"
            )
            break
    chosen = next((p for p in at_largest if p.strategy == choice.strategy), best)
    communication = {name: seconds for name, seconds in chosen.breakdown.items() if name in COMMUNICATION}
    if communication:
        name, seconds = max(communication.items(), key=lambda item: item[1])
        bound = network_name if (name == "all_reduce" and chosen.nodes > 1 and network_name) else link_name
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
    if what_if is not None:
        for change, words in (
            ("faster-link", "the fastest link"),
            ("faster-network", "the fastest network"),
            ("double-batch", "twice the batch per device"),
        ):
            changed = what_if(change)
            if not changed:
                continue
            best_changed = max(
                (p for p in changed if p.total_devices == largest), key=lambda p: p.samples_per_second, default=None
            )
            dp_changed = next((p for p in changed if p.strategy == dp_name and p.total_devices == largest), None)
            if best_changed is None:
                continue
            text = f"with {words}: best {best_changed.strategy} {best_changed.speedup:.2f}x"
            if dp_changed is not None:
                text += f", {dp_changed.strategy} {dp_changed.speedup:.2f}x"
            reasons.append("what would change the answer: " + text)
    choice.reasons = reasons
    return choice
