"""Synchronizing every H steps as an option beside the recommendation, never as the recommendation.

Strategies whose replicas train alone and meet every H steps (localsgd: local SGD, Stich 2019, Lin et al. 2020;
diloco: Douillard et al. 2023) send about H times fewer bytes than any strategy that synchronizes every step, but
they change the optimization: between meetings each replica follows its own rows. So the advisor never recommends
them (advisor.every_step), and `auto` never picks them. Where every-step synchronization dominates the step even with
the best compression (the exposed communication is still the largest part of the fastest configuration that
synchronizes every step, with the compression asked, or without one asked with the one the compression advice would
name for it: the most faithful that pays, compression_advice.py),
a reason line names them with the step they would take on as many devices, with the same compression on their
meetings' exchange, and the caveat; the JSON's recommendation carries the figures as `periodic`:

    {"strategies": ["localsgd", "diloco"],
     "instead_of": {"strategy": "ddp", "options": {}, "devices": 16, "compress": "powersgd:4", "step_seconds": ...},
     "options": [{"strategy": "localsgd", "options": {}, "sync_every": 8, "devices": 16, "compress": "powersgd:4",
                  "step_seconds": ..., "samples_per_second": ..., "peak_bytes_per_device": ...}, ...],
     "changes_optimization": true, "caveat": "they change the optimization: ..."}

Where the step is computing (or anything else) first, or they would not shorten it by compression_advice.PAYS, or
do not fit, nothing is said of them and `periodic` is null.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from dpkit.plan.advice_words import milliseconds
from dpkit.plan.advisor import Recommendation, every_step, usable
from dpkit.plan.compression_advice import (
    PAYS,
    Rerun,
    compressed_variants,
    exchange_seconds,
    largest_part,
    most_faithful_that_pays,
)
from dpkit.plan.cost_model import Prediction
from dpkit.plan.periodic_sync import periodic_strategies
from dpkit.strategies import strategy_traits
from dpkit.strategies.compression import Compression, parse_compression

CAVEAT = "they change the optimization: compare the quality on your model first (docs/strategies.md)"


def add_periodic_option(
    recommendation: Recommendation,
    predictions: Sequence[Prediction],
    asked: Compression,
    rerun: Rerun,
    strategy_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """The option line and `recommendation.periodic`, where every-step synchronization dominates the step even with
    the best compression (the module doc); `strategy_options`: the plan's, by strategy (--sync-every, ...)."""
    if recommendation.strategy is None:
        return
    best = best_every_step(predictions, recommendation, asked, rerun)
    if best is None or largest_part(best)[0] != "communication":
        return
    compression = parse_compression(best.compress)
    options = []
    for name in periodic_strategies():
        planned = dict((strategy_options or {}).get(name, {}))
        option = rerun(replace(best, strategy=name, options=planned), compression)
        if usable(option) and option.step_seconds <= (1 - PAYS) * best.step_seconds:
            options.append(option)
    if not options:
        return
    at = next(
        (i for i, reason in enumerate(recommendation.reasons) if reason.startswith("what would change the answer")),
        len(recommendation.reasons),
    )
    recommendation.reasons.insert(at, option_line(best, options))
    recommendation.periodic = option_figures(best, options)


def best_every_step(
    predictions: Sequence[Prediction], recommendation: Recommendation, asked: Compression, rerun: Rerun
) -> Prediction | None:
    """The fastest usable configuration that synchronizes every step on the recommended devices (on the most devices
    where one device is recommended): with the compression asked, or without one asked with the one the compression
    advice names for it (the most faithful that pays; none where none does). None without one on several devices."""
    weighed = [p for p in every_step(predictions) if usable(p) and p.total_devices > 1]
    if not weighed:
        return None
    recommended = recommendation.devices or 1
    target = recommended if recommended > 1 else max(p.total_devices for p in weighed)
    at_best = []
    for prediction in (p for p in weighed if p.total_devices == target):
        variants = {} if asked.compresses else compressed_variants(prediction, rerun)
        fitting = {kind: variant for kind, variant in variants.items() if usable(variant)}
        pick = most_faithful_that_pays(prediction, fitting)
        at_best.append(fitting[pick] if pick is not None else prediction)
    return min(at_best, key=lambda p: p.step_seconds, default=None)


def sync_every(prediction: Prediction) -> int:
    return strategy_traits(prediction.strategy, **prediction.options).sync_every


def option_line(best: Prediction, options: Sequence[Prediction]) -> str:
    """The reason line: the strategies and their period, the step they would take against the fastest every-step
    configuration's, what becomes of the exchange, and the caveat."""
    names = "/".join(p.strategy for p in options)
    periods = sorted({sync_every(p) for p in options})
    every = f"every {periods[0]} steps" if len(periods) == 1 else "every " + "/".join(map(str, periods)) + " steps"
    steps = [milliseconds(p.step_seconds) for p in options]
    to = steps[0] if len(set(steps)) == 1 else " and ".join(f"{s} ({p.strategy})" for s, p in zip(steps, options))
    compressed = f" with {best.compress}" if best.compress != "none" else ""
    meeting = max(p.breakdown.get("all_reduce", 0.0) for p in options)
    return (
        f"{names} {every} would take the step from {milliseconds(best.step_seconds)} ({best.strategy}{compressed}, "
        f"the fastest that synchronizes every step) to {to}: one all-reduce of the weights' moves{compressed} per "
        f"meeting, {milliseconds(meeting)} a step, in place of {milliseconds(exchange_seconds(best))} of gradient "
        f"exchange every step; {CAVEAT}"
    )


def option_figures(best: Prediction, options: Sequence[Prediction]) -> dict[str, Any]:
    """`recommendation.periodic` in the JSON (the module doc)."""
    return {
        "strategies": [p.strategy for p in options],
        "instead_of": {
            "strategy": best.strategy,
            "options": dict(best.options),
            "devices": best.total_devices,
            "compress": best.compress,
            "step_seconds": best.step_seconds,
            "samples_per_second": best.samples_per_second,
        },
        "options": [
            {
                "strategy": p.strategy,
                "options": dict(p.options),
                "sync_every": sync_every(p),
                "devices": p.total_devices,
                "compress": p.compress,
                "step_seconds": p.step_seconds,
                "samples_per_second": p.samples_per_second,
                "peak_bytes_per_device": max(p.peak_bytes_per_device),
            }
            for p in options
        ],
        "changes_optimization": True,
        "caveat": CAVEAT,
    }
