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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpkit.checkpoint.errors import CheckpointCorruptError
from dpkit.checkpoint.generators import check_rng, restore_rng
from dpkit.checkpoint.model_files import check_state_dict
from dpkit.checkpoint.shards import check_shard_shapes, load_into, read_whole, verify_shards
from dpkit.checkpoint.state import ProcessState, SharedState
from dpkit.engine.resume.checks import (
    Undo,
    check_named_object,
    check_optimizer_class,
    check_optimizer_state,
    optimizer_snapshot,
)
from dpkit.engine.together import agreed
from dpkit.engine.wrappers import SetUp
from dpkit.strategies import Strategy
from dpkit.strategies.named_state import numbered_optimizer_state

log = logging.getLogger("dpkit")

# a loader's saved position, and this process's generator states for its epoch's order (None between epochs)
LoaderPosition = tuple[dict[str, Any], dict[str, Any] | None]


@dataclass
class ReadState:
    """What a load read of the model and the optimizers, checked: whole, or left in the shards."""

    shards: Path | None  # the sharded state's folder, if it is one
    sharded_load: bool  # this strategy reads its own shards of it (DCP reshards them)
    model_state: dict[str, Any] | None  # the whole model; None: the shards load into the model
    optimizers: list[dict[str, Any]]  # each optimizer's whole state (placeholders when the shards load)


def load_training_state(
    set_up: SetUp, chosen: Path, shared: SharedState, mine: ProcessState, objects: dict[str, Any]
) -> tuple[dict[str, Any], list[LoaderPosition]]:
    """Load the state read from step directory `chosen` (its shared part and this process's) into `set_up` and
    the named `objects`, all or nothing (engine.load_state's work). Returns the extras' values and every saved
    loader's position, for the loaders set up later."""
    # check everything first, every process agreeing before any fails (engine/together.py)
    read = agreed(set_up.strategy, lambda: read_model_and_optimizers(set_up, chosen, shared))
    agreed(set_up.strategy, lambda: check_everything_else(set_up, chosen, shared, mine, objects, read))
    extras = shared.get("extra", {})
    # then change everything: the steps a load_state_dict could still refuse first, each undone on a failure
    undo = Undo()
    try:
        load_undoable(set_up, chosen, shared, read, objects, undo)
    except Exception as error:
        raise undo.back(error, chosen) from error
    # the step, loaders and generators, which cannot fail, once everything else is in
    pending = load_the_rest(set_up, chosen, shared, mine)
    return {name: entry["value"] for name, entry in extras.items()}, pending


def read_model_and_optimizers(set_up: SetUp, chosen: Path, shared: SharedState) -> ReadState:
    """The model's and the optimizers' saved states, checked against the model: from state.pt, from the shards
    joined (any strategy resumes a sharded run), or left in the shards for a sharded strategy to read its own."""
    bare, source = set_up.model, chosen / "state.pt"
    folder = shared.get("shards")
    if not folder:
        model_state = check_state_dict(bare, shared.get("model") or {}, source)
        saved = shared.get("optimizers") or []
        states = [optimizer for optimizer in saved if isinstance(optimizer, dict)]
        if len(states) != len(saved):
            raise CheckpointCorruptError(f"{source}: an optimizer's state is missing (saved as None)")
        return ReadState(None, False, model_state, states)
    shards = chosen / folder
    verify_shards_together(set_up.strategy, shards, shared.get("shard_digests") or {})
    groups = shared.get("optimizer_groups", [])
    if set_up.strategy.traits.sharded:
        check_shard_shapes(bare, shards)
        return ReadState(shards, True, None, [{"param_groups": []}] * len(groups))
    whole = read_whole(shards)
    in_shards = whole.get("optimizers", {})
    optimizers = [
        numbered_optimizer_state(in_shards[str(index)])
        if str(index) in in_shards
        else {"state": {}, "param_groups": optimizer.optimizer.state_dict()["param_groups"]}  # saved fresh
        for index, optimizer in enumerate(set_up.optimizers[: len(groups)])
    ]
    return ReadState(shards, False, check_state_dict(bare, whole.get("model", {}), shards), optimizers)


def check_everything_else(
    set_up: SetUp, chosen: Path, shared: SharedState, mine: ProcessState, objects: dict[str, Any], read: ReadState
) -> None:
    """The optimizers against what was read, then the loaders, generators, step and named objects."""
    check_optimizers(set_up, shared, read)
    check_the_rest(set_up, chosen, shared, mine, objects)


def check_optimizers(set_up: SetUp, shared: SharedState, read: ReadState) -> None:
    """As many optimizers as were saved, each of the saved class, with param groups of the saved sizes and (whole)
    per-parameter state that fits its parameters."""
    if len(read.optimizers) != len(set_up.optimizers):
        raise ValueError(
            f"optimizer: the state holds {len(read.optimizers)} optimizer(s), "
            f"this engine set up {len(set_up.optimizers)}; "
            "set up the same model and optimizer(s) before engine.load_state"
        )
    saved_classes = list(shared.get("optimizer_classes") or [])  # absent from states saved before it was recorded
    for index, (engine_optimizer, saved) in enumerate(zip(set_up.optimizers, read.optimizers)):
        groups = [len(group["params"]) for group in engine_optimizer.param_groups]
        if read.sharded_load:
            saved_groups: list[int] | None = list(shared.get("optimizer_groups", [])[index])
        elif isinstance(saved, dict):
            saved_groups = [len(group.get("params", ())) for group in saved.get("param_groups", [])]
        else:
            saved_groups = None
        check_optimizer_class(
            index, engine_optimizer.optimizer, saved_classes[index] if index < len(saved_classes) else None
        )
        if groups != saved_groups:
            raise ValueError(
                f"optimizer {index}: the state has param groups of sizes {saved_groups}, this optimizer {groups}; "
                "build the optimizer as in the saved run"
            )
        if not read.sharded_load:
            check_optimizer_state(index, engine_optimizer.optimizer, saved)


def check_the_rest(
    set_up: SetUp, chosen: Path, shared: SharedState, mine: ProcessState, objects: dict[str, Any]
) -> None:
    """The loaders' positions, the generators, the step and the named objects' kinds."""
    source = chosen / "state.pt"
    order_states = mine.get("loaders", [])
    for index, (loader, position) in enumerate(zip(set_up.loaders, shared.get("loaders", []))):
        loader.check_position(position, f"{source}: loaders[{index}]")
        if position["next_batch"] > 0 and (index >= len(order_states) or order_states[index] is None):
            raise CheckpointCorruptError(
                f"{source}: loaders[{index}] stopped mid-epoch, "
                "but the state holds no generator states for that epoch's order"
            )
    check_rng(mine.get("rng"), chosen)
    step = shared.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointCorruptError(f"{source}: its step ({step!r}) is not a step count")
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


def load_undoable(
    set_up: SetUp, chosen: Path, shared: SharedState, read: ReadState, objects: dict[str, Any], undo: Undo
) -> None:
    """Named objects, the GradScaler, the strategy's own state, the optimizers, and the model last (its keys,
    shapes and types are checked), or the shards; each kept in `undo` before it changes."""
    extras = shared.get("extra", {})
    for name, target in objects.items():
        undo.keep(name, target, copy.deepcopy(target.state_dict()))
        saved = extras[name]["value"]
        if isinstance(target, nn.Module):  # keyed as it names them: saved through a wrapper, or bare, loads
            saved = check_state_dict(target, saved, chosen / "state.pt")
        target.load_state_dict(saved)
    scaler, scaler_state = set_up.precision.scaler, shared.get("scaler")
    if scaler is not None and scaler_state:
        undo.keep("the GradScaler", scaler, scaler.state_dict())
        scaler.load_state_dict(scaler_state)
    strategy = set_up.strategy
    strategy_state = shared.get("strategy_state")
    if strategy_state and shared.get("strategy") == strategy.name and shared.get("world_size") == strategy.world_size:
        undo.keep(f"strategy {strategy.name}", strategy, copy.deepcopy(strategy.state_dict()))
        strategy.load_state_dict(strategy_state)
    optimizers = [optimizer.optimizer for optimizer in set_up.optimizers]
    if read.sharded_load and read.shards is not None:  # (sharded_load: there are shards)
        undo.step = "the sharded model and optimizers"
        load_shards(strategy, set_up.model, optimizers, shared.get("optimizers_in_shards") or [], read.shards)
        return
    for index, (optimizer, saved) in enumerate(zip(optimizers, read.optimizers)):
        undo.keep(f"optimizer {index}", optimizer, optimizer_snapshot(optimizer))
        strategy.load_optimizer_state(optimizer, saved)
    undo.step = "the model"
    if read.model_state is not None:  # (read whole unless the shards load themselves)
        strategy.load_model_state(set_up.model, read.model_state)


def load_the_rest(set_up: SetUp, chosen: Path, shared: SharedState, mine: ProcessState) -> list[LoaderPosition]:
    """The step, the loaders' positions, the generators, the intra-op threads and the replica runner's choices;
    returns every saved loader's position (with this process's order state), for loaders set up later."""
    set_up.accumulation.steps = int(shared.get("step", 0))
    set_up.accumulation.micro_batches, set_up.accumulation.stepped = 0, False
    positions, order_states = shared.get("loaders", []), mine.get("loaders", [])
    padded = list(order_states) + [None] * (len(positions) - len(order_states))
    pending = list(zip(positions, padded))
    for loader, (position, order_state) in zip(set_up.loaders, pending):
        loader.resume_from(position, order_state)
    restore_rng(mine["rng"])
    threads = mine.get("threads")
    if (
        set_up.strategy.root_device.type == "cpu"
        and isinstance(threads, int)
        and 0 < threads != torch.get_num_threads()
    ):
        log.info(
            "%s: computing with its %d intra-op threads (this process had %d)", chosen, threads, torch.get_num_threads()
        )
        torch.set_num_threads(threads)
    concurrency = mine.get("concurrency")
    if concurrency:  # the saved run's choices; a call site it had not decided measures again
        set_up.strategy.set_concurrency(concurrency)
    load_process_state(set_up.strategy, chosen, shared, mine)
    log.info("resumed from %s at step %d", chosen, set_up.step)
    return pending


def load_process_state(strategy: Strategy, chosen: Path, shared: SharedState, mine: ProcessState) -> None:
    """What this process's strategy kept of its own (the compressed exchange's error feedback and factors): its own
    again under the same strategy on as many processes, else said in one line and left fresh (each process's
    error feedback belongs to the rank that made it)."""
    state = mine.get("strategy")
    if not state:
        return
    same = shared.get("strategy") == strategy.name and shared.get("world_size") == strategy.world_size
    note = strategy.load_process_state(state) if same else "it belongs to another layout's processes"
    if note:
        log.info("%s: the strategy's own state is not carried (%s); it starts afresh", chosen, note)


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
