"""engine.save / engine.load: the whole model as one clean checkpoint file, through the strategy.

Under every strategy the file is the one dpkit.save_model writes for the bare model (no wrapper prefixes,
atomic, with a checksum): the strategy gives the whole state dict on rank 0 (a sharded one gathers it, a
collective), rank 0 writes it and every process waits; a load checks the file against the model and the
strategy loads it into every copy it trains (a sharded one takes its shards of it).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from torch import nn

from dpkit.checkpoint.model_files import check_state_dict, read_model_file, save_state_dict, unwrap_model
from dpkit.launch.heartbeat import busy

if TYPE_CHECKING:
    from dpkit.strategies import Strategy


def save_whole_model(strategy: Strategy, model: nn.Module, path: str | os.PathLike) -> None:
    """Rank 0 writes `model`'s whole clean state dict to `path`; every process calls it and waits for it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    with busy("saving the model"):  # rank 0 writes while the others wait: progress, not a hang
        state = strategy.model_state(unwrap_model(model))
        if strategy.rank == 0 and state is not None:  # (rank 0 holds the state)
            save_state_dict(state, path)
        strategy.barrier()


def load_whole_model(strategy: Strategy, model: nn.Module, path: str | os.PathLike) -> None:
    """Load a checkpoint file (clean or prefixed keys) into the set-up `model` in this process, every copy of it."""
    with busy("loading the model"):
        bare = unwrap_model(model)
        device = strategy.root_device
        state = read_model_file(path, map_location="cpu" if device.type == "cpu" else device)
        strategy.load_model_state(bare, check_state_dict(bare, state, path))
