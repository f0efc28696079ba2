"""dpkit inside Lightning: one-process data parallelism for the Trainer and for Fabric, on GPUs or on
virtual CPU devices (the `lightning` extra: pip install 'dpkit[lightning]').

    from dpkit.lightning import DataParallelStrategy, FabricDataParallelStrategy
    trainer = lightning.Trainer(strategy=DataParallelStrategy("replicated", devices=["cpu:0", "cpu:1"]))
    fabric = lightning.fabric.Fabric(strategy=FabricDataParallelStrategy("dp", devices=["cpu:0", "cpu:1"]))

Importing it also registers the names "dpkit_dp", "dpkit_dp_balanced" and "dpkit_replicated" with both, so
Trainer(strategy="dpkit_replicated", accelerator="cpu", devices=2) works too. See docs/lightning.md.
"""

from __future__ import annotations

try:
    import lightning.fabric.strategies as _fabric_strategies
    import lightning.pytorch.strategies as _trainer_strategies
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError(
        "dpkit.lightning needs the lightning package (2.2 or newer): pip install 'dpkit[lightning]'"
    ) from error

from dpkit.integrations.lightning.arguments import modes
from dpkit.integrations.lightning.fabric import FabricDataParallelStrategy
from dpkit.integrations.lightning.replicas import StepReplicas
from dpkit.integrations.lightning.trainer import REGISTERED_NAMES, DataParallelStrategy

__all__ = ["REGISTERED_NAMES", "DataParallelStrategy", "FabricDataParallelStrategy", "StepReplicas", "modes"]

DataParallelStrategy.register_strategies(_trainer_strategies.StrategyRegistry)
FabricDataParallelStrategy.register_strategies(_fabric_strategies.STRATEGY_REGISTRY)
