"""dpkit: data-parallel training for PyTorch, on GPUs and on virtual CPU devices."""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below load on first use (__getattr__), so `import dpkit.launch` stays light
    from dpkit import observe
    from dpkit.devices import cpu_devices
    from dpkit.errors import DpkitError
    from dpkit.observe import Observer
    from dpkit.observe.collectives import CollectiveMismatch
    from dpkit.parallel import Broadcast, DataParallel, split_sizes
    from dpkit.plan.auto import choose_strategy
    from dpkit.training.checkpoint import (
        load_model,
        save_model,
        strip_prefixes,
        unwrap_model,
    )
    from dpkit.training.checkpoint_errors import (
        CheckpointCorruptError,
        CheckpointMismatchError,
        CheckpointRefusedError,
        CheckpointWriteError,
    )
    from dpkit.training.engine import Engine
    from dpkit.training.loop_checks import NonFiniteLoss

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
    "CheckpointCorruptError": "dpkit.training.checkpoint_errors",
    "CheckpointMismatchError": "dpkit.training.checkpoint_errors",
    "CheckpointRefusedError": "dpkit.training.checkpoint_errors",
    "CheckpointWriteError": "dpkit.training.checkpoint_errors",
    "CollectiveMismatch": "dpkit.observe.collectives",
    "DataParallel": "dpkit.parallel",
    "DpkitError": "dpkit.errors",
    "Engine": "dpkit.training.engine",
    "NonFiniteLoss": "dpkit.training.loop_checks",
    "Observer": "dpkit.observe",
    "choose_strategy": "dpkit.plan.auto",
    "cpu_devices": "dpkit.devices",
    "load_model": "dpkit.training.checkpoint",
    "save_model": "dpkit.training.checkpoint",
    "split_sizes": "dpkit.parallel",
    "strip_prefixes": "dpkit.training.checkpoint",
    "unwrap_model": "dpkit.training.checkpoint",
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


# Modules that moved when the package was grouped by job: their old names still import, with a warning.
MOVED_MODULES = {
    "dpkit.engine": "dpkit.training.engine",
    "dpkit.state": "dpkit.training.state",
    "dpkit.checkpoint": "dpkit.training.checkpoint",
    "dpkit.bench": "dpkit.tools.bench",
    "dpkit.doctor": "dpkit.tools.doctor",
    "dpkit.hf_trainer": "dpkit.integrations.hf_trainer",
}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import dpkit.engine` gives dpkit.training.engine itself (one module object, one set of classes)."""

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in MOVED_MODULES else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(
            f"{spec.name} moved to {MOVED_MODULES[spec.name]}; import it from there", DeprecationWarning, stacklevel=2
        )
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:  # the module is the moved one, already run
        pass


if not any(isinstance(finder, _MovedModule) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModule())
