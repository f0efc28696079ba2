"""dpkit: data-parallel training for PyTorch, on GPUs and on virtual CPU devices."""

from dpkit import observe
from dpkit.devices import cpu_devices
from dpkit.errors import DpkitError
from dpkit.observe import Observer
from dpkit.parallel import Broadcast, DataParallel, split_sizes
from dpkit.training.checkpoint import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    load_model,
    save_model,
    strip_prefixes,
    unwrap_model,
)
from dpkit.training.engine import Engine

__version__ = "0.1.0"

__all__ = [
    "Broadcast",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "DataParallel",
    "DpkitError",
    "Engine",
    "Observer",
    "cpu_devices",
    "load_model",
    "observe",
    "save_model",
    "split_sizes",
    "strip_prefixes",
    "unwrap_model",
]
