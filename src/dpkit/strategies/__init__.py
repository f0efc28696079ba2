"""How devices cooperate in one step: one module per strategy, and this registry, the only list of them.

Adding a strategy is adding its module here and one line to STRATEGIES; any other module in this package
(helpers a strategy shares) is not a strategy. Code outside this package asks the registry and the
strategies' traits (base.Traits), never compares a name:

    strategy_class("ddp").traits.processes == PER_DEVICE
    reference()                               # the one-device strategy every other must equal
    matching(lambda traits: traits.sharded)   # the strategies with some trait
    strategy_traits("fsdp", reshard_after_forward=False).gathers   # an instance's traits, from its options
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dpkit.strategies.base import (
    ALL_PROCESSES,
    FOR_THE_STEP,
    IN_REPLICAS,
    NO_GATHER,
    NO_REPLICAS,
    ON_ROOT,
    ONE_NODE,
    ONE_PROCESS,
    PER_DEVICE,
    PER_STEP,
    PER_UNIT,
    PERSISTENT,
    SHARDED,
    WHOLE,
    DeferredOutput,
    Strategy,
    Traits,
)
from dpkit.strategies.compression import parse_compression

__all__ = [
    "ALL_PROCESSES",
    "FOR_THE_STEP",
    "IN_REPLICAS",
    "NO_GATHER",
    "NO_REPLICAS",
    "ONE_NODE",
    "ONE_PROCESS",
    "ON_ROOT",
    "PERSISTENT",
    "PER_DEVICE",
    "PER_STEP",
    "PER_UNIT",
    "SHARDED",
    "STRATEGIES",
    "WHOLE",
    "DeferredOutput",
    "Strategy",
    "Traits",
    "available_strategies",
    "create_strategy",
    "matching",
    "reference",
    "strategy_class",
    "strategy_traits",
]

# name -> "module:class", in the order tables and plots show them; modules are imported on first use
STRATEGIES: dict[str, str] = {
    "single": "dpkit.strategies.single:Single",
    "dp": "dpkit.strategies.dp:DP",
    "dp-balanced": "dpkit.strategies.dp_balanced:DPBalanced",
    "replicated": "dpkit.strategies.replicated:Replicated",
    "ddp": "dpkit.strategies.ddp:DDP",
    "fsdp": "dpkit.strategies.fsdp:FSDP",
    "zero": "dpkit.strategies.zero:Zero",
    "hsdp": "dpkit.strategies.hsdp:HSDP",
    "localsgd": "dpkit.strategies.localsgd:LocalSGD",
    "diloco": "dpkit.strategies.diloco:DiLoCo",
}


def available_strategies() -> list[str]:
    """Every strategy's name, in the registry's order."""
    return list(STRATEGIES)


def strategy_class(name: str, argument: str = "strategy") -> type[Strategy]:
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ValueError(f"{argument}: unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    module_name, class_name = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def strategy_traits(name: str, **options: Any) -> Traits:
    """The traits of strategy `name` built with `options` (its class's own with none)."""
    return strategy_class(name).traits_for(**options)


def matching(predicate: Callable[[Traits], bool]) -> list[str]:
    """The names of the strategies whose traits satisfy `predicate`, in the registry's order."""
    return [name for name in STRATEGIES if predicate(strategy_class(name).traits)]


def reference() -> str:
    """The strategy every other is measured and checked against: the whole batch on one device."""
    return matching(lambda traits: traits.max_devices == 1)[0]


def checked_compression(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` with `compress` checked against what strategy `name` (built with the other options) can take
    (Traits.compressions): one line naming the argument, the value and what this strategy and the others take.
    compress="none" (and its warm-up) is dropped for a strategy that has no exchange to compress."""
    options = dict(options)
    if "compress" not in options and "compress_warmup_steps" not in options:
        return options
    compression = parse_compression(options.get("compress"), options.get("compress_warmup_steps"))
    cls = strategy_class(name)
    others = {key: value for key, value in options.items() if key not in ("compress", "compress_warmup_steps")}
    takes = cls.traits_for(**others).compressions
    if compression.kind in takes and "compress" in cls.options:
        return options
    if not compression.compresses:
        return others
    takers = [
        other
        for other in STRATEGIES
        if any(compression.kind in strategy_class(other).traits_for(**variant).compressions
               for variant in ({}, *strategy_class(other).planned_variants))
    ]  # fmt: skip
    why = (
        f"reduce-scatters gradients to their shards and takes {' or '.join(takes[1:])} only"
        if "bf16" in takes
        else "has no gradient exchange to compress (one device, or replicas copied afresh each step whose gradients "
        "autograd sums onto the first device)"
    )
    if compression.kind == "powersgd":
        takers = [f"{other} stage 1" if other == "zero" else other for other in takers]
    raise ValueError(
        f"compress: strategy '{name}'{_variant(others)} {why}, got {str(compression)!r}; "
        f"{compression.kind} goes with {', '.join(takers)}"
    )


def _variant(options: Mapping[str, Any]) -> str:
    return "".join(f" {key}={value}" for key, value in sorted(options.items()) if key in ("stage", "shard_size"))


def create_strategy(name: str, devices: Sequence[torch.device], *, precision: str = "32", **options: Any) -> Strategy:
    """An instance of the strategy called `name` (one of STRATEGIES) on `devices`, built for `precision`."""
    cls = strategy_class(name)
    options = checked_compression(name, options)
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        accepted = ", ".join(cls.options) or "none"
        raise TypeError(f"{unknown[0]}: not an option of strategy '{name}' (its options: {accepted})")
    return cls.built_as(**options)(devices, precision=precision, **options)
