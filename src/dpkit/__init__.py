"""dpkit: data-parallel training for PyTorch, on GPUs and on virtual CPU devices."""

from dpkit.checkpoint import CheckpointMismatchError, load_model, save_model, unwrap_model
from dpkit.devices import cpu_devices
from dpkit.errors import DpkitError
from dpkit.parallel import Broadcast, split_sizes
from dpkit import observe
from dpkit.observe import Observer
from dpkit.observe.calibration import DataParallel  # parallel's DataParallel, balance= measured with dpkit.observe
from dpkit.engine import Engine

__version__ = "0.1.0"

__all__ = [
    "Broadcast",
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
    "unwrap_model",
]
