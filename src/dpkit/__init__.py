"""dpkit: data-parallel training for PyTorch, on GPUs and on virtual CPU devices."""

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below load on first use (__getattr__), so `import dpkit.launch` stays light
    from dpkit import observe
    from dpkit.checkpoint.errors import (
        CheckpointCorruptError,
        CheckpointMismatchError,
        CheckpointRefusedError,
        CheckpointWriteError,
    )
    from dpkit.checkpoint.model_files import (
        load_model,
        save_model,
        strip_prefixes,
        unwrap_model,
    )
    from dpkit.devices import cpu_devices
    from dpkit.engine.engine import Engine
    from dpkit.engine.loop_checks import NonFiniteLoss
    from dpkit.errors import DpkitError
    from dpkit.observe import Observer
    from dpkit.observe.collectives import CollectiveMismatch
    from dpkit.parallel import Broadcast, DataParallel, split_sizes
    from dpkit.plan.auto import choose_strategy

__version__ = "0.1.0"

__all__ = [
    "Broadcast",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointRefusedError",
    "CheckpointWriteError",
    "CollectiveMismatch",
    "DataParallel",
    "DpkitError",
    "Engine",
    "NonFiniteLoss",
    "Observer",
    "choose_strategy",
    "cpu_devices",
    "load_model",
    "observe",
    "save_model",
    "split_sizes",
    "strip_prefixes",
    "unwrap_model",
]


# Where each public name lives. A launched worker imports dpkit.launch.worker before the user's script: with
# every name loaded eagerly, each worker would pay for torch, torch.distributed.tensor and the planner even when
# the script needs none of them (seconds per process on a small machine).
PUBLIC_NAMES = {
    "Broadcast": "dpkit.parallel",
    "CheckpointCorruptError": "dpkit.checkpoint.errors",
    "CheckpointMismatchError": "dpkit.checkpoint.errors",
    "CheckpointRefusedError": "dpkit.checkpoint.errors",
    "CheckpointWriteError": "dpkit.checkpoint.errors",
    "CollectiveMismatch": "dpkit.observe.collectives",
    "DataParallel": "dpkit.parallel",
    "DpkitError": "dpkit.errors",
    "Engine": "dpkit.engine.engine",
    "NonFiniteLoss": "dpkit.engine.loop_checks",
    "Observer": "dpkit.observe",
    "choose_strategy": "dpkit.plan.auto",
    "cpu_devices": "dpkit.devices",
    "load_model": "dpkit.checkpoint.model_files",
    "save_model": "dpkit.checkpoint.model_files",
    "split_sizes": "dpkit.parallel",
    "strip_prefixes": "dpkit.checkpoint.model_files",
    "unwrap_model": "dpkit.checkpoint.model_files",
}


def __getattr__(name: str) -> Any:
    """A public name, or a subpackage (`dpkit.observe`, `dpkit.parallel`, …), imported on first use."""
    if name in PUBLIC_NAMES:
        value = getattr(importlib.import_module(PUBLIC_NAMES[name]), name)
        if PUBLIC_NAMES[name] == "dpkit.parallel":
            # DataParallel(balance="memory") measures its steps with the planner dpkit.observe plugs into the seam
            importlib.import_module("dpkit.observe.measured_balance")
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
