"""Saving a training state: what the Engine set up, written as one step directory, all or nothing.

Holds the model (clean keys), the optimizers, the GradScaler, the step, the position of every loader, every
process's generator states and intra-op thread count, and the user's extras; a sharded strategy's model and
optimizers go to shards/ (checkpoint/shards.py). The directory is written by checkpoint/writes.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

from dpkit.checkpoint.generators import capture_rng
from dpkit.checkpoint.model_files import detached_on_cpu, strip_prefixes
from dpkit.checkpoint.state import ProcessState, SharedState, check_keep, kind_of, pack_extras
from dpkit.checkpoint.steps import STATE_FORMAT
from dpkit.checkpoint.writes import write_state_directory
from dpkit.engine.wrappers import SetUp

log = logging.getLogger("dpkit")


@dataclass
class StagedState:
    """A training state as one save writes it: every process's part, taken at one step (`copied`: its tensors are
    copies, which the training may go on changing the originals of while it is written in the background)."""

    directory: Path
    step: int
    shared: SharedState | None
    mine: ProcessState
    shards: dict[str, Any] | None
    keep: int | None
    rank: int
    copied: bool


def stage_training_state(
    set_up: SetUp, directory: str | os.PathLike, *, keep: int | None, extra: dict[str, Any], copy: bool = False
) -> StagedState:
    """What a save of `set_up` writes, gathered now (collective where the state is spread: every process calls it);
    with copy=True every tensor is copied, so that writing it later writes this step's state."""
    keep = check_keep(keep)
    if set_up.optimizers and not set_up.accumulation.at_boundary:  # without the Engine's optimizer no window is known
        raise RuntimeError(
            f"engine.save_state: called after micro-batch {set_up.accumulation.micro_batches} "
            f"of {set_up.accumulation.every} of an "
            "accumulation window, before its optimizer.step(); call it after optimizer.step()"
        )
    bare = set_up.model
    optimizers = [optimizer.optimizer for optimizer in set_up.optimizers]
    # every process takes part: a sharded strategy's processes each write their shards (DCP); another
    # strategy whose state is spread over the processes gathers it to rank 0 here
    # an optimizer that has not stepped has no state to shard (asking for it would make torch initialize
    # it, changing its next step): it is saved as fresh, and a load leaves it fresh
    stepped = {str(index): optimizer for index, optimizer in enumerate(optimizers) if optimizer.state}
    shards = set_up.strategy.sharded_state(bare, stepped)
    model_state, optimizer_states = None, None
    if shards is None:
        model_state = set_up.strategy.model_state(bare)
        optimizer_states = [set_up.strategy.optimizer_state(optimizer) for optimizer in optimizers]
    shared: SharedState | None = None
    if set_up.is_global_zero:
        shared = SharedState(
            format=STATE_FORMAT,
            step=set_up.step,
            strategy=set_up.strategy.name,
            layout=set_up.strategy.layout(),
            world_size=set_up.strategy.world_size,
            devices=[str(d) for d in set_up.devices],
            precision=set_up.precision.precision,
            accumulate=set_up.accumulation.every,
            model=None if model_state is None else detached_on_cpu(strip_prefixes(model_state)),
            optimizers=optimizer_states,
            # with shards: the optimizers' param group sizes, checked before a load reads any shard
            optimizer_groups=[[len(group["params"]) for group in opt.param_groups] for opt in optimizers],
            optimizers_in_shards=sorted(stepped) if shards is not None else None,
            # each optimizer's class: a load refuses another class's state (Adam's moments into SGD)
            optimizer_classes=[kind_of(getattr(opt, "user", opt)) for opt in optimizers],
            scaler=set_up.precision.scaler.state_dict() if set_up.precision.scaler is not None else None,
            loaders=[loader.position() for loader in set_up.loaders],
            # what a strategy learned that decides its arithmetic (dp-balanced: its chunk sizes)
            strategy_state=set_up.strategy.state_dict() or None,
            extra=pack_extras(extra),
        )
    mine: ProcessState = {
        "rank": set_up.strategy.rank,
        "rng": capture_rng(),
        "loaders": [loader.order_state() for loader in set_up.loaders],
        # intra-op threads split a large reduction (a matrix product's inner sum, a norm) into per-thread
        # partial sums, so their count decides the result's last bits: a resume computes with the same count
        "threads": torch.get_num_threads(),
        # how the replica runner's auto call sites decided to run (parallel/concurrency.py): a resume runs so
        "concurrency": set_up.strategy.concurrency_choice(),
        # what this process's strategy keeps of its own (the compressed exchange's state: PowerSGD's)
        "strategy": set_up.strategy.process_state(),
    }
    staged = StagedState(Path(directory), set_up.step, shared, mine, shards, keep, set_up.strategy.rank, copy)
    if copy:
        staged.shared = copied(shared)
        staged.mine = copied(mine)
        staged.shards = copied(shards)
    return staged


def copied(value: Any) -> Any:
    """`value` with every tensor in it copied into host memory (detached; a DTensor stays one, its local shard
    copied), the rest as it is (nested dicts, lists and tuples): a GPU's memory holds no second copy."""
    return tree_map(lambda leaf: leaf.detach().to("cpu", copy=True) if isinstance(leaf, torch.Tensor) else leaf, value)


def write_staged_state(
    staged: StagedState,
    *,
    barrier: Callable[[], None],
    gather: Callable[[Any], list[Any]] | None,
    shard_group: Any = None,
    committing: AbstractContextManager[Any] | None = None,
) -> Path:
    """Write a staged state as one step directory, all or nothing, and point `latest` at it (every process; the
    shards over `shard_group`, the commit inside `committing`: checkpoint/writes.py)."""
    written = write_state_directory(
        staged.directory,
        staged.step,
        staged.shared,
        staged.mine,
        rank=staged.rank,
        keep=staged.keep,
        barrier=barrier,
        shards=staged.shards,
        gather=gather,
        shard_group=shard_group,
        committing=committing,
    )
    if staged.rank == 0:
        log.info("saved the training state at step %d to %s", staged.step, written)
    return written


def save_training_state(
    set_up: SetUp, directory: str | os.PathLike, *, keep: int | None, extra: dict[str, Any]
) -> Path:
    """Save `set_up` into `directory`/step-NNNNNNNN and point `directory`/latest at it (engine.save_state's work;
    every process calls it). Returns the step directory written."""
    staged = stage_training_state(set_up, directory, keep=keep, extra=extra)
    # all or nothing in every process: a failure anywhere (a full disk) raises everywhere and leaves the
    # previous states and `latest` as they were
    return write_staged_state(staged, barrier=set_up.strategy.barrier, gather=set_up.strategy.all_gather_object)
