"""How devices cooperate in one step: one module per strategy, found by name.

`strategy="dp-balanced"` loads `dpkit.strategies.dp_balanced` and uses its `STRATEGY` class, so adding a
strategy is adding one module here.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Sequence

import torch

from dpkit.strategies.base import DeferredOutput, Strategy

__all__ = ["DeferredOutput", "Strategy", "available_strategies", "create_strategy"]


def available_strategies() -> list[str]:
    names = [info.name for info in pkgutil.iter_modules(__path__) if info.name != "base"]
    return sorted(name.replace("_", "-") for name in names)


def create_strategy(name: str, devices: Sequence[torch.device], **options: Any) -> Strategy:
    """An instance of the strategy called `name` ("single", "dp", "dp-balanced", "replicated", "ddp")."""
    if not isinstance(name, str) or name.replace("-", "_") not in {n.replace("-", "_") for n in available_strategies()}:
        raise ValueError(f"strategy: unknown strategy {name!r}; choose one of {', '.join(available_strategies())}")
    module = importlib.import_module(f"dpkit.strategies.{name.replace('-', '_')}")
    return module.STRATEGY(devices, **options)
