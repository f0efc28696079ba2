"""How devices cooperate in one step: one module per strategy, named in STRATEGIES.

Adding a strategy is adding its module here and one line to the table; any other module in this package
(helpers a strategy shares) is not a strategy.
"""

from __future__ import annotations

import importlib
from typing import Any, Sequence

import torch

from dpkit.strategies.base import DeferredOutput, Strategy

__all__ = ["STRATEGIES", "DeferredOutput", "Strategy", "available_strategies", "create_strategy"]

# name -> "module:class"; modules are imported on first use (ddp pulls in torch.distributed)
STRATEGIES: dict[str, str] = {
    "single": "dpkit.strategies.single:Single",
    "dp": "dpkit.strategies.dp:DP",
    "dp-balanced": "dpkit.strategies.dp_balanced:DPBalanced",
    "replicated": "dpkit.strategies.replicated:Replicated",
    "ddp": "dpkit.strategies.ddp:DDP",
}


def available_strategies() -> list[str]:
    return sorted(STRATEGIES)


def strategy_class(name: str) -> type[Strategy]:
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ValueError(f"strategy: unknown strategy {name!r}; choose one of {', '.join(available_strategies())}")
    module_name, class_name = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def create_strategy(name: str, devices: Sequence[torch.device], **options: Any) -> Strategy:
    """An instance of the strategy called `name` ("single", "dp", "dp-balanced", "replicated", "ddp")."""
    return strategy_class(name)(devices, **options)
