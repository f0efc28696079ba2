"""Writing a training state: all or nothing, in every process.

The state is written into a temporary sibling of its step directory, every file fsynced, renamed into
place, and then the folder's `latest` pointer is replaced atomically. A save that fails in any process
raises in every process and leaves the previous states and `latest` as they were.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpkit.checkpoint.checked_files import atomic_write, fsync_directory, os_error_in, write_checked, write_error
from dpkit.checkpoint.errors import CheckpointWriteError
from dpkit.checkpoint.shards import SHARDS, shard_digests, write_shards
from dpkit.checkpoint.steps import (
    LATEST,
    STATE_FILE,
    aside_path,
    complete_at_a_glance,
    pointer_text,
    remove_path,
    step_directories,
    step_directory_name,
    step_number,
)

if TYPE_CHECKING:
    from dpkit.checkpoint.state import ProcessState, SharedState

log = logging.getLogger("dpkit")


def remove_stale_state_temporaries(root: Path) -> None:
    for aside in root.glob(".step-*.old.tmp"):  # a replaced state whose replacement never arrived: put it back
        final = root / aside.name[1 : -len(".old.tmp")]
        if not final.exists() and (aside / STATE_FILE).is_file():
            os.rename(aside, final)
            log.info("restored %s, which an interrupted save had moved aside", final)
    for stale in itertools.chain(root.glob(".step-*.tmp"), root.glob(f".{LATEST}.*.tmp")):
        remove_path(stale)
        log.debug("removed %s, left by an interrupted save", stale)


def remove_old_states(root: Path, written: Path, keep: int) -> None:
    """Keep the newest `keep` complete states up to `written` (itself included); remove the older ones.

    Stray entries are never counted or removed, a damaged state (a file missing) is not counted, and states
    newer than `written` (left from before the run went back to an earlier state) are left alone."""
    step = step_number(written)
    older = [path for path in step_directories(root) if path != written and step_number(path) < step]
    complete = [path for path in older if complete_at_a_glance(path)]
    kept = complete[max(0, len(complete) - (keep - 1)) :] if keep > 1 else []
    oldest_kept = step_number(kept[0]) if kept else step
    for path in older:
        if step_number(path) < oldest_kept:
            remove_path(path)
            log.debug("removed %s (keep=%d)", path, keep)


def _raise_write_failure(error: BaseException, path: Path) -> None:
    """Raise a write's failure in one line when it is the storage's (a full disk), else the error itself."""
    failure = os_error_in(error)
    if failure is None or isinstance(error, CheckpointWriteError):
        raise error
    raise write_error(failure, path, "the previous state is intact") from error


def _together(agree: Callable[[str | None], list[str | None]], action: Callable[[], None]) -> None:
    """Run this process's part of a step of the save; then every process learns whether every part succeeded,
    and all raise if one failed (none waits for a process that gave up)."""
    failed: BaseException | None = None
    try:
        action()
    except Exception as error:  # noqa: BLE001 - every failure is told to the other processes, then raised
        failed = error
    said = agree(None if failed is None else str(failed) or type(failed).__name__)
    if failed is not None:
        raise failed
    intact = "; the previous state is intact"
    for rank, message in enumerate(said):
        if message:
            raise CheckpointWriteError(
                f"process {rank} could not write its part of the state: {message.removesuffix(intact)}{intact}"
            )


@dataclass
class _SaveProgress:
    """How far a save got, for undoing it."""

    replaced: Path | None = None  # the same step's earlier state, moved aside
    placed: bool = False
    pointed: bool = False


def write_state_directory(
    root: str | os.PathLike,
    step: int,
    shared: SharedState | None,
    mine: ProcessState,
    *,
    rank: int,
    keep: int | None,
    barrier: Callable[[], None],
    shards: dict[str, Any] | None = None,
    gather: Callable[[str | None], list[str | None]] | None = None,
    shard_group: Any = None,
    committing: AbstractContextManager[Any] | None = None,
) -> Path:
    """Write one state directory; every process calls this (rank 0 passes `shared`). With `shards` (a sharded
    strategy's state, on every process) each process writes its shards into the folder SHARDS through
    torch.distributed.checkpoint (over `shard_group`, by default the default group), and rank 0 records every
    shard file's SHA-256 in `shared`. `committing` is entered around the rename and the move of `latest` (a save
    abandoned before then raises there, and nothing of it is committed).

    All or nothing: a save that fails in any process (a full disk, a write error) raises in every process
    (given `gather`, an all_gather_object; with `barrier` alone only in the process that failed), removes
    what it wrote and leaves the previous states and `latest` as they were."""
    root = Path(root)
    name = step_directory_name(step)
    final, temporary = root / name, root / f".{name}.tmp"
    if root.exists() and not root.is_dir():  # every process checks, so none waits for a rank 0 that failed here
        raise NotADirectoryError(f"directory: {root} is a file; give a folder for the training state")

    def agree_at_barrier(message: str | None) -> list[str | None]:
        barrier()
        return [message]

    agree = gather if gather is not None else agree_at_barrier
    done = _SaveProgress()

    def begin() -> None:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            remove_stale_state_temporaries(root)
            temporary.mkdir()

    def write_files() -> None:
        if rank == 0 and shards is not None and shared is not None:  # (rank 0 passes `shared`)
            shared["shards"], shared["shard_digests"] = SHARDS, shard_digests(temporary / SHARDS)
        files = [(f"rank-{rank}.pt", mine)] + ([(STATE_FILE, shared)] if rank == 0 else [])
        for file_name, content in files:
            try:
                with open(temporary / file_name, "wb") as handle:
                    write_checked(content, handle)
            except BaseException as error:
                _raise_write_failure(error, final / file_name)

    def place() -> None:
        if rank != 0:
            return
        with committing or contextlib.nullcontext():
            commit()

    def commit() -> None:
        if (temporary / SHARDS).is_dir():
            fsync_directory(temporary / SHARDS)
        fsync_directory(temporary)
        if final.exists() or final.is_symlink():  # the same step saved again: move the old one aside, then drop it
            done.replaced = aside_path(root, name)
            os.rename(final, done.replaced)
        os.rename(temporary, final)
        done.placed = True
        fsync_directory(root)
        try:
            atomic_write(root / LATEST, lambda handle: handle.write(pointer_text(name).encode()))
        except BaseException as error:
            _raise_write_failure(error, root / LATEST)
        done.pointed = True
        if done.replaced is not None:
            remove_path(done.replaced)
        if keep is not None:
            remove_old_states(root, final, keep)

    try:
        _together(agree, begin)
        if shards is not None:
            try:  # DCP's save is a collective that raises in every process when one fails
                write_shards(shards, temporary / SHARDS, shard_group)
            except BaseException as error:
                _raise_write_failure(error, final / SHARDS)
        _together(agree, write_files)
        _together(agree, place)
    except BaseException:
        if rank == 0 and not done.pointed:
            _undo_save(temporary, final, done.replaced, placed=done.placed)
        raise
    return final


def _undo_save(temporary: Path, final: Path, replaced: Path | None, *, placed: bool) -> None:
    """After a failed save: its files removed, the state it was replacing back in place (latest never moved)."""
    try:
        if placed:
            remove_path(final)
        if replaced is not None and replaced.exists() and not final.exists():
            os.rename(replaced, final)
        remove_path(temporary)
    except OSError as error:  # the failure being raised matters more; the next save removes what is left
        log.warning("could not remove what the failed save left in %s: %s", temporary.parent, error)
