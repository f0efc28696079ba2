"""Resumable training state: reading a state directory, and what the state records of the user's objects.

What makes a resumed run equal to one that never stopped, besides weights and optimizer state: every
generator that touches training (checkpoint/generators.py) and the data position (engine/resumable_loader.py).

A state is a directory `step-NNNNNNNN/` under the folder the user names (checkpoint/steps.py), holding
`state.pt` (what every process shares: model, optimizers, scaler, step, data position, extras; written by
rank 0) and `rank-R.pt` (each process's generators); a sharded strategy's model and optimizers are in
`shards/` instead, each process's part written by itself (checkpoint/shards.py). Writing it is all or nothing
(checkpoint/writes.py).

Reading tells no state from a damaged one: FileNotFoundError only when the folder holds no state at all;
a state missing a file or holding one its save did not write, or a `latest` naming a state that is gone,
is a CheckpointCorruptError.
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch

from dpkit.checkpoint.errors import CheckpointCorruptError
from dpkit.checkpoint.model_files import read_checked
from dpkit.checkpoint.shards import ignored_name
from dpkit.checkpoint.steps import (
    STATE_FILE,
    STATE_FORMAT,
    find_state,
    pointer_text,
)
from dpkit.checks import check_int

if TYPE_CHECKING:
    from torch.serialization import MAP_LOCATION as MapLocation

log = logging.getLogger("dpkit")


class SharedState(TypedDict, total=False):
    """state.pt: what every process shares, written by rank 0 (engine/resume/save.py; read by engine/resume/load.py,
    recipe/checks.py and `dpkit ckpt`). Every key is present in a state this dpkit wrote; older states may lack the
    ones marked so, which is why readers use .get()."""

    format: str  # STATE_FORMAT
    step: int  # optimizer steps taken
    strategy: str  # the registry's name of the strategy that saved it
    layout: str  # the strategy with what its options chose ("zero stage 2", "hsdp 2x2 (replicate x shard)")
    world_size: int  # processes that saved it: one rank-R.pt each
    devices: list[str]
    precision: str
    accumulate: int  # micro-batches per optimizer step
    model: dict[str, Any] | None  # the whole model, clean keys, on the CPU; None when `shards` holds it
    optimizers: list[dict[str, Any] | None] | None  # each optimizer's state dict; None when `shards` holds them
    optimizer_groups: list[list[int]]  # each optimizer's param group sizes, checked before any shard is read
    optimizers_in_shards: list[str] | None  # the optimizers (by index) that had stepped, saved in `shards`
    optimizer_classes: list[str]  # kind_of() of each optimizer (absent from early states)
    scaler: dict[str, Any] | None  # the GradScaler's state
    loaders: list[dict[str, int]]  # each loader's position (ResumableLoader.position)
    strategy_state: dict[str, Any] | None  # what the strategy learned that decides its arithmetic
    extra: dict[str, dict[str, Any]]  # the user's extras (pack_extras)
    shards: str  # the shards folder's name, in a sharded state only (checkpoint/writes.py)
    shard_digests: dict[str, str]  # SHA-256 of every shard file, by its path in the folder


class ProcessState(TypedDict, total=False):
    """rank-R.pt: what process R alone holds (engine/resume/save.py)."""

    rank: int
    rng: dict[str, Any]  # its generators (checkpoint/generators.py)
    loaders: list[dict[str, Any] | None]  # each loader's generator states from its epoch's start
    threads: int  # its intra-op thread count: a resume computes with the same
    concurrency: dict[str, str]  # how the replica runner's auto call sites decided to run
    strategy: dict[str, Any] | None  # what its strategy keeps of its own (the compressed exchange's state)


_pointer_text = pointer_text  # the name tests/recipe/test_recipe_history.py imports


def check_state_files(folder: Path, shared: SharedState) -> None:
    """Raise CheckpointCorruptError unless `folder` holds exactly the files its state.pt says it was saved with:
    state.pt, one rank-R.pt per process, and the shards folder of a sharded state."""
    world = shared.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise CheckpointCorruptError(f"{folder / STATE_FILE}: its world size ({world!r}) is not a process count")
    expected = {STATE_FILE: "file", **{f"rank-{r}.pt": "file" for r in range(world)}}
    if shared.get("shards"):
        expected[shared["shards"]] = "folder"
    present = {path.name: path for path in folder.iterdir() if not ignored_name(path.name)}
    missing = [name for name in expected if name not in present]
    if missing:
        listing = f"{STATE_FILE}, rank-0.pt" + (f" … rank-{world - 1}.pt" if world > 1 else "")
        raise CheckpointCorruptError(
            f"{folder}: this state is incomplete: {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing (saved by {world} process(es), it holds {listing}"
            + (f" and {shared['shards']}/" if shared.get("shards") else "")
            + "); restore it from a backup, or load an earlier state by passing its step directory"
        )
    extra = sorted(set(present) - set(expected))
    if extra:
        raise CheckpointCorruptError(
            f"{folder}: holds {', '.join(extra)}, which this state's save did not write; the folder was changed since "
            "(files mixed in from another state?): remove what you put there, or load an earlier state"
        )
    for name, kind in expected.items():
        if (kind == "file") != present[name].is_file() or (kind == "folder") != present[name].is_dir():
            raise CheckpointCorruptError(f"{present[name]}: expected a {kind}; this state is damaged")


def read_state_directory(
    directory: str | os.PathLike, rank: int, *, map_location: MapLocation = "cpu"
) -> tuple[Path, SharedState, ProcessState]:
    """(step directory, shared state, this rank's state); a rank the saved run did not have reads rank 0's.

    A state missing a file, or holding one its save did not write, is a CheckpointCorruptError naming it
    (never a FileNotFoundError, which means that no state was saved)."""
    chosen = find_state(directory)
    if not (chosen / STATE_FILE).is_file():
        raise CheckpointCorruptError(
            f"{chosen / STATE_FILE}: missing, so {chosen} is not a complete state; restore it from a backup, or load "
            "an earlier state by passing its step directory"
        )
    shared = read_checked(chosen / STATE_FILE, map_location=map_location)
    check_state_format(shared, chosen / STATE_FILE)
    check_state_files(chosen, shared)
    own = chosen / f"rank-{rank}.pt"
    if not own.is_file():
        own = chosen / "rank-0.pt"
        log.info(
            "%s: saved by %d process(es); process %d takes rank 0's generator states",
            chosen,
            shared.get("world_size", 1),
            rank,
        )
    mine = read_checked(own, map_location="cpu")
    if not isinstance(mine, dict):
        raise CheckpointCorruptError(f"{own}: not a dpkit per-process state")
    return chosen, cast(SharedState, shared), cast(ProcessState, mine)


def check_state_format(shared: object, source: object) -> None:
    """Raise CheckpointCorruptError unless `shared` is a training state in the format this dpkit reads."""
    found = shared.get("format") if isinstance(shared, dict) else None
    if found == STATE_FORMAT:
        return
    if isinstance(found, str) and found.startswith(STATE_FORMAT.split("/")[0] + "/"):
        raise CheckpointCorruptError(
            f"{source}: a training state in format {found!r}, which this dpkit does not read (it reads and writes "
            f"{STATE_FORMAT!r}); load it with the dpkit version that saved it"
        )
    raise CheckpointCorruptError(
        f"{source}: not a dpkit training state "
        f"(format {found if isinstance(shared, dict) else type(shared).__name__!r}, expected {STATE_FORMAT!r})"
    )


def check_keep(keep: int | None) -> int | None:
    if keep is not None:
        check_int(keep, "keep", meaning="states to keep, or None for all")
    return keep


def pack_extras(extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The user's extra objects as values weights_only loading can read; objects with state_dict() by their state."""
    packed = {}
    for key, value in extra.items():
        if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            # with its class, so that a load refuses to give it to another kind of object
            packed[key] = {"kind": "state_dict", "value": value.state_dict(), "class": kind_of(value)}
        else:
            packed[key] = {"kind": "value", "value": value}
        buffer = io.BytesIO()
        try:
            torch.save(packed[key], buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
        except Exception as error:  # noqa: BLE001 - any failure means it cannot come back
            raise TypeError(
                f"{key}: a {type(value).__name__} cannot be saved in the training state (it must load back with "
                "weights_only=True); pass numbers, strings, lists, dicts and tensors, or an object with state_dict()"
            ) from error
    return packed


def kind_of(obj: object) -> str:
    """An object's class as the state records it ('torch.optim.sgd.SGD')."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def short_kind(kind: str) -> str:
    """The class name of a recorded kind ('SGD')."""
    return kind.rsplit(".", 1)[-1]


def same_kind(saved: object, here: str) -> bool | None:
    """Whether a recorded kind is `here`'s class, by class name (a class that moved to another module, or ran as
    __main__ when saved, is the same); None when nothing usable was recorded."""
    if not isinstance(saved, str) or not saved:
        return None
    return saved.rsplit(".", 1)[-1] == here.rsplit(".", 1)[-1]
