"""Loading a training state into what the Engine set up: everything checked first, then changed, or nothing.

Read and checked first: the model's keys and shapes, every optimizer's class, param groups and per-parameter
state, every named object's kind, the loaders' positions, the generators (engine/resume/checks.py). Then
changed, each step undone if a later one fails: named objects, the GradScaler, the strategy's own state,
the optimizers and the model (or a sharded strategy's shards, which DCP reshards to this layout). The step,
loaders and generators, which cannot fail, last.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpkit.checkpoint.errors import CheckpointCorruptError
from dpkit.checkpoint.generators import check_rng, restore_rng
from dpkit.checkpoint.model_files import check_state_dict
from dpkit.checkpoint.shards import check_shard_shapes, load_into, read_whole, verify_shards
from dpkit.engine.resume.checks import (
    Undo,
    check_named_object,
    check_optimizer_class,
    check_optimizer_state,
    optimizer_snapshot,
)
from dpkit.engine.wrappers import SetUp
from dpkit.strategies import Strategy
from dpkit.strategies.named_state import numbered_optimizer_state

log = logging.getLogger("dpkit")

# a loader's saved position, and this process's generator states for its epoch's order (None between epochs)
LoaderPosition = tuple[dict[str, Any], dict[str, Any] | None]


def load_training_state(
    set_up: SetUp, chosen: Path, shared: dict[str, Any], mine: dict[str, Any], objects: dict[str, Any]
) -> tuple[dict[str, Any], list[LoaderPosition]]:
    """Load the state read from step directory `chosen` (its shared part and this process's) into `set_up` and
    the named `objects`, all or nothing (engine.load_state's work). Returns the extras' values and every saved
    loader's position, for the loaders set up later."""
    source = chosen / "state.pt"
    bare = set_up.model
    optimizers = [optimizer.optimizer for optimizer in set_up.optimizers]
    # --- check everything first ---
    shards = chosen / shared["shards"] if shared.get("shards") else None
    sharded_load = False  # this strategy reads its own shards of a sharded state (DCP reshards them)
    model_state: dict[str, Any] | None  # None: the shards load into the model
    saved_optimizers: list[dict[str, Any]]
    if shards is not None:
        verify_shards_together(set_up.strategy, shards, shared.get("shard_digests") or {})
        sharded_load = set_up.strategy.traits.sharded
        if sharded_load:
            check_shard_shapes(bare, shards)
            model_state, saved_optimizers = None, [{"param_groups": []}] * len(shared["optimizer_groups"])
        else:  # a whole state in this process: the shards joined (any strategy resumes a sharded run)
            whole = read_whole(shards)
            model_state = check_state_dict(bare, whole.get("model", {}), shards)
            in_shards = whole.get("optimizers", {})
            saved_optimizers = [
                numbered_optimizer_state(in_shards[str(index)])
                if str(index) in in_shards
                else {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}  # saved fresh
                for index, optimizer in enumerate(optimizers[: len(shared["optimizer_groups"])])
            ]
    else:
        model_state = check_state_dict(bare, shared.get("model", {}), source)
        saved_optimizers = shared.get("optimizers", [])
    if len(saved_optimizers) != len(set_up.optimizers):
        raise ValueError(
            f"optimizer: the state holds {len(saved_optimizers)} optimizer(s), "
            f"this engine set up {len(set_up.optimizers)}; "
            "set up the same model and optimizer(s) before engine.load_state"
        )
    saved_classes = list(shared.get("optimizer_classes") or [])  # absent from states saved before it was recorded
    for index, (engine_optimizer, saved) in enumerate(zip(set_up.optimizers, saved_optimizers)):
        groups = [len(group["params"]) for group in engine_optimizer.param_groups]
        saved_groups = (
            [len(group.get("params", ())) for group in saved.get("param_groups", [])]
            if isinstance(saved, dict)
            else None
        )
        if sharded_load:
            saved_groups = list(shared["optimizer_groups"][index])
        check_optimizer_class(
            index, engine_optimizer.optimizer, saved_classes[index] if index < len(saved_classes) else None
        )
        if groups != saved_groups:
            raise ValueError(
                f"optimizer {index}: the state has param groups of sizes {saved_groups}, this optimizer {groups}; "
                "build the optimizer as in the saved run"
            )
        if not sharded_load:
            check_optimizer_state(index, engine_optimizer.optimizer, saved)
    positions = shared.get("loaders", [])
    order_states = mine.get("loaders", [])
    for index, (loader, position) in enumerate(zip(set_up.loaders, positions)):
        loader.check_position(position, f"{source}: loaders[{index}]")
        if position["next_batch"] > 0 and (index >= len(order_states) or order_states[index] is None):
            raise CheckpointCorruptError(
                f"{source}: loaders[{index}] stopped mid-epoch, "
                "but the state holds no generator states for that epoch's order"
            )
    check_rng(mine.get("rng"), chosen)
    if not isinstance(shared.get("step"), int) or isinstance(shared["step"], bool) or shared["step"] < 0:
        raise CheckpointCorruptError(f"{source}: its step ({shared.get('step')!r}) is not a step count")
    extras = shared.get("extra", {})
    for name, target in objects.items():
        check_named_object(name, target, extras, source)
    if shared.get("world_size") != set_up.strategy.world_size or shared.get("strategy") != set_up.strategy.name:
        log.info(
            "resuming a state saved by strategy %s on %s process(es) under strategy %s on %d",
            shared.get("strategy"),
            shared.get("world_size"),
            set_up.strategy.name,
            set_up.strategy.world_size,
        )
    # --- then change everything: the steps a load_state_dict could still refuse first, each undone on a
    # failure; the model last (its keys, shapes and types are checked); the step, loaders and generators,
    # which cannot fail, once everything else is in
    undo = Undo()
    try:
        for name, target in objects.items():
            undo.keep(name, target, copy.deepcopy(target.state_dict()))
            saved = extras[name]["value"]
            if isinstance(target, nn.Module):  # keyed as it names them: saved through a wrapper, or bare, loads
                saved = check_state_dict(target, saved, source)
            target.load_state_dict(saved)
        if set_up.precision.scaler is not None and shared.get("scaler"):
            undo.keep("the GradScaler", set_up.precision.scaler, set_up.precision.scaler.state_dict())
            set_up.precision.scaler.load_state_dict(shared["scaler"])
        strategy_state = shared.get("strategy_state")
        if (
            strategy_state
            and shared.get("strategy") == set_up.strategy.name
            and shared.get("world_size") == set_up.strategy.world_size
        ):
            undo.keep(f"strategy {set_up.strategy.name}", set_up.strategy, copy.deepcopy(set_up.strategy.state_dict()))
            set_up.strategy.load_state_dict(strategy_state)
        if sharded_load and shards is not None:  # (sharded_load: there are shards)
            undo.step = "the sharded model and optimizers"
            load_shards(set_up.strategy, bare, optimizers, shared["optimizers_in_shards"], shards)
        else:
            for index, (optimizer, saved) in enumerate(zip(optimizers, saved_optimizers)):
                undo.keep(f"optimizer {index}", optimizer, optimizer_snapshot(optimizer))
                set_up.strategy.load_optimizer_state(optimizer, saved)
            undo.step = "the model"
            if model_state is not None:  # (read whole unless the shards load themselves)
                set_up.strategy.load_model_state(bare, model_state)
    except Exception as error:
        raise undo.back(error, chosen) from error
    set_up.accumulation.steps, set_up.accumulation.micro_batches, set_up.accumulation.stepped = (
        int(shared["step"]),
        0,
        False,
    )
    padded = list(order_states) + [None] * (len(positions) - len(order_states))
    pending = list(zip(positions, padded))
    for loader, (position, order_state) in zip(set_up.loaders, pending):
        loader.resume_from(position, order_state)
    restore_rng(mine["rng"])
    threads = mine.get("threads")
    if (
        set_up.strategy.root_device.type == "cpu"
        and isinstance(threads, int)
        and threads > 0
        and threads != torch.get_num_threads()
    ):
        log.info(
            "%s: computing with its %d intra-op threads (this process had %d)",
            chosen,
            threads,
            torch.get_num_threads(),
        )
        torch.set_num_threads(threads)
    concurrency = mine.get("concurrency")
    if concurrency:  # the saved run's choices; a call site it had not decided measures again
        set_up.strategy.set_concurrency(concurrency)
    log.info("resumed from %s at step %d", chosen, set_up.step)
    return {name: entry["value"] for name, entry in extras.items()}, pending


def verify_shards_together(strategy: Strategy, folder: Path, digests: dict[str, str]) -> None:
    """Every shard file's checksum, each process checking its part; all raise if any part is damaged."""
    names = sorted(digests)
    mine = {name: digests[name] for name in names[strategy.rank :: strategy.world_size]}
    try:
        verify_shards(folder, mine, every=names)
        problem = None
    except CheckpointCorruptError as error:
        problem = str(error)
    found = next((p for p in strategy.all_gather_object(problem) if p), None)
    if found:
        raise CheckpointCorruptError(found)


def load_shards(
    strategy: Strategy, bare: nn.Module, optimizers: list[torch.optim.Optimizer], in_shards: list[str], folder: Path
) -> None:
    """Read this process's shards into copies, then apply them: a load that fails leaves the model as it was,
    and the optimizers too (asking a fresh optimizer for its sharded state initializes it; undone here).
    An optimizer saved before its first step is left fresh."""
    before = [optimizer.state_dict() for optimizer in optimizers]
    saved = {name: optimizers[int(name)] for name in in_shards}
    try:
        state = strategy.sharded_state(bare, saved)
        if state is None:  # (only a sharded strategy loads shards)
            raise RuntimeError(f"strategy {strategy.name!r} keeps no sharded state to load shards into")
        filled = load_into(state, folder)
    except Exception:
        for optimizer, state in zip(optimizers, before):
            optimizer.load_state_dict(state)
        raise
    strategy.load_sharded_state(bare, saved, filled)
    for index, optimizer in enumerate(optimizers):
        if str(index) not in saved:
            optimizer.load_state_dict({"state": {}, "param_groups": optimizer.state_dict()["param_groups"]})
