"""The host memory a save written in the background takes, and `dpkit train`'s refusal when it will not fit.

A background save (checkpoint_every=K without sync_checkpoints) stages a copy of every tensor of the training state
in host memory until its thread has written it: the model's state (weights and buffers) and the optimizer's
per-parameter state (AdamW and Adam: two moments; SGD with momentum: one buffer; plain SGD: none), for at most one
save in flight. What each node stages follows the strategy's traits: a whole state is gathered to rank 0, whose
node stages all of it; a sharded one is staged by every process, each its share. The first process of each node
that stages compares that with what its machine has available now, and every process agrees on the outcome
(engine/together.py), so that all of them refuse, or none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import psutil
import torch
from torch import nn

from dpkit.engine.placement import Placement
from dpkit.engine.together import agreed
from dpkit.recipe.config import TrainConfig
from dpkit.strategies import Strategy
from dpkit.strategies.base import WHOLE, Traits

# the optimizer state the recipe's optimizers keep per parameter, in tensors of its size, and what they are called
_MOMENTS = {"adamw": (2, "AdamW's two moments"), "adam": (2, "Adam's two moments")}
_SGD_MOMENTUM = (1, "SGD's momentum")


@dataclass(frozen=True)
class StagedCopy:
    """One whole staged copy of a run's training state, by part."""

    model_bytes: int  # the model's state dict: weights and buffers
    optimizer_bytes: int  # the optimizer's per-parameter state once it has stepped
    optimizer_state: str  # what that state is ("AdamW's two moments"); "" for plain SGD, which keeps none

    @property
    def total_bytes(self) -> int:
        return self.model_bytes + self.optimizer_bytes

    def parts(self) -> str:
        return "the weights" + (f" and {self.optimizer_state}" if self.optimizer_state else "")


def staged_copy(model: nn.Module, optimizer: str, momentum: float) -> StagedCopy:
    """What one staged copy of `model`'s training state holds under the recipe's `optimizer` (the model whole, as
    built, before any strategy shards it)."""
    model_bytes = sum(value.nbytes for value in model.state_dict().values() if isinstance(value, torch.Tensor))
    trainable_bytes = sum(parameter.nbytes for parameter in model.parameters() if parameter.requires_grad)
    count, what = _MOMENTS.get(optimizer, _SGD_MOMENTUM if momentum else (0, ""))
    return StagedCopy(model_bytes, count * trainable_bytes, what)


def node_bytes(copy: StagedCopy, traits: Traits, processes: int, per_node: int) -> int:
    """What one node stages: all of a whole state (on rank 0's node); of a sharded one, each of its processes' share
    (a part each process keeps whole, such as zero stage 1's weights, is staged whole by each)."""
    if not traits.sharded:
        return copy.total_bytes
    shards = traits.shard_size(processes, per_node)

    def share(kept: str, size: int) -> int:
        return size if kept == WHOLE else math.ceil(size / shards)

    return per_node * (share(traits.weights, copy.model_bytes) + share(traits.optimizer_state, copy.optimizer_bytes))


def available_bytes() -> int:
    """The host memory this machine can give now without swapping."""
    return int(psutil.virtual_memory().available)


def size_text(size_bytes: float) -> str:
    """1.2 GB, 89.5 MB, 640 kB (powers of 1000, as `free -h --si` and the docs say them)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:.1f} {unit}"
    return f"{size_bytes:.0f} B"


def saves_in_background(config: TrainConfig, step: int) -> bool:
    """Whether a run at `step` has a save left that is written in the background: one every checkpoint_every steps
    before the last (a stop's save and the last one are written in place)."""
    every = config.checkpoint_every
    if not every or config.sync_checkpoints:
        return False
    return (step // every + 1) * every < config.steps


def check_node_memory(config: TrainConfig, copy: StagedCopy, traits: Traits, placement: Placement) -> None:
    """This process's part of the check: the first process of a node that stages compares what the node stages with
    what its machine has available; one line naming checkpoint_every, the sizes and the fix."""
    per_node = len(placement.devices) if placement.per_device else 1
    decides = placement.local_rank == 0 if traits.sharded else placement.rank == 0
    if not decides:
        return
    needed, available = node_bytes(copy, traits, placement.processes, per_node), available_bytes()
    if needed <= available:
        return
    parts = copy.parts()
    if traits.sharded:
        parts = f"this node's {per_node} processes' shares of {parts}"
    where = f" on node {placement.node_rank}" if placement.processes > per_node else ""
    raise ValueError(
        f"checkpoint_every: {config.checkpoint_every} saves in the background, staging a copy of the training state "
        f"in host memory ({size_text(needed)}: {parts}), but {size_text(available)} is available{where}; pass "
        "sync_checkpoints=True to write each save in place, or free memory"
    )


def check_save_memory(
    config: TrainConfig, copy: StagedCopy, strategy: Strategy, placement: Placement, step: int
) -> None:
    """Refuse a run at `step` whose background saves would not fit in host memory, in every process alike."""
    if saves_in_background(config, step):
        agreed(strategy, lambda: check_node_memory(config, copy, strategy.traits, placement))
