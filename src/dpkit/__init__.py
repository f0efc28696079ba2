"""dpkit: data-parallel training for PyTorch, on GPUs and on virtual CPU devices."""

from dpkit.checkpoint import CheckpointMismatchError, load_model, save_model, unwrap_model
from dpkit.devices import cpu_devices
from dpkit.errors import DpkitError
from dpkit.parallel import Broadcast, DataParallel, split_sizes

__version__ = "0.1.0"

__all__ = [
    "Broadcast",
    "CheckpointMismatchError",
    "DataParallel",
    "DpkitError",
    "cpu_devices",
    "load_model",
    "save_model",
    "split_sizes",
    "unwrap_model",
]
