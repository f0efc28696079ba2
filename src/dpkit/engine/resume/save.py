"""Saving a training state: what the Engine set up, written as one step directory, all or nothing.

Holds the model (clean keys), the optimizers, the GradScaler, the step, the position of every loader, every
process's generator states and intra-op thread count, and the user's extras; a sharded strategy's model and
optimizers go to shards/ (checkpoint/shards.py). The directory is written by checkpoint/writes.py.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from dpkit.checkpoint.generators import capture_rng
from dpkit.checkpoint.model_files import detached_on_cpu, strip_prefixes
from dpkit.checkpoint.state import ProcessState, SharedState, check_keep, kind_of, pack_extras
from dpkit.checkpoint.steps import STATE_FORMAT
from dpkit.checkpoint.writes import write_state_directory
from dpkit.engine.wrappers import SetUp

log = logging.getLogger("dpkit")


def save_training_state(
    set_up: SetUp, directory: str | os.PathLike, *, keep: int | None, extra: dict[str, Any]
) -> Path:
    """Save `set_up` into `directory`/step-NNNNNNNN and point `directory`/latest at it (engine.save_state's work;
    every process calls it). Returns the step directory written."""
    keep = check_keep(keep)
    if set_up.optimizers and not set_up.accumulation.at_boundary:  # without the Engine's optimizer no window is known
        raise RuntimeError(
            f"engine.save_state: called after micro-batch {set_up.accumulation.micro_batches} "
            f"of {set_up.accumulation.every} of an "
            "accumulation window, before its optimizer.step(); call it after optimizer.step()"
        )
    directory = Path(directory)
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
    # all or nothing in every process: a failure anywhere (a full disk) raises everywhere and leaves the
    # previous states and `latest` as they were
    written = write_state_directory(
        directory,
        set_up.step,
        shared,
        mine,
        rank=set_up.strategy.rank,
        keep=keep,
        barrier=set_up.strategy.barrier,
        shards=shards,
        gather=set_up.strategy.all_gather_object,
    )
    if set_up.is_global_zero:
        log.info("saved the training state at step %d to %s", set_up.step, written)
    return written
