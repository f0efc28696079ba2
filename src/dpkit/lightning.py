"""dpkit for Lightning users: `DataParallelStrategy` for the Trainer, `FabricDataParallelStrategy` for Fabric.

The public name of dpkit.integrations.lightning (see there and docs/lightning.md); importing it registers
the strategy names "dpkit_dp", "dpkit_dp_balanced" and "dpkit_replicated" with Lightning.
"""

from dpkit.integrations.lightning import (
    REGISTERED_NAMES,
    DataParallelStrategy,
    FabricDataParallelStrategy,
    modes,
)

__all__ = ["REGISTERED_NAMES", "DataParallelStrategy", "FabricDataParallelStrategy", "modes"]
