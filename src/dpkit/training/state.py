"""Resumable training state: random number generators, the data position, and the state directory.

What makes a resumed run equal to one that never stopped, besides weights and optimizer state:

- Every generator that touches training: Python's `random`, NumPy's global generator, torch's CPU
  generator and every CUDA generator. dpkit's per-replica generators are seeded from torch's CPU
  generator at each step, so capturing that one captures them.
- The data position: which epoch the loader is in and how many global batches of it were used. The
  order of an epoch is drawn when its iterator starts (a shuffling sampler draws a permutation from its
  generator or torch's), so the loader also keeps the generator states from the start of the epoch; a
  resumed epoch redraws the same order from them and skips the used batches by index, without loading
  their data.

A state is a directory `step-NNNNNNNN/` under the folder the user names, holding `state.pt` (what every
process shares: model, optimizers, scaler, step, data position, extras; written by rank 0) and
`rank-R.pt` (each process's generators); a sharded strategy's model and optimizers are in `shards/`
instead, each process's part written by itself (training/shards.py). It is written into a temporary
sibling, every file fsynced, renamed into place, and then the folder's `latest` pointer is replaced
atomically. A save that fails in any process raises in every process and leaves the previous states and
`latest` as they were.

Reading tells no state from a damaged one: FileNotFoundError only when the folder holds no state at all;
a state missing a file or holding one its save did not write, or a `latest` naming a state that is gone,
is a CheckpointCorruptError. Stray `step-*` entries (step-00000005.bak, a file, an empty folder) are
never states: ignored with a warning, never counted or removed by `keep`.
"""

from __future__ import annotations

import collections
import hashlib
import io
import itertools
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from dpkit.checks import check_int
from dpkit.training.checkpoint import (
    CheckpointCorruptError,
    CheckpointWriteError,
    atomic_write,
    fsync_directory,
    os_error_in,
    read_checked,
    write_checked,
    write_error,
)
from dpkit.training.shards import SHARDS, ignored_name, shard_digests, write_shards

log = logging.getLogger("dpkit")

STATE_FORMAT = "dpkit-state/1"
STATE_FILE = "state.pt"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


# --- random number generators --------------------------------------------------------------------------


def capture_rng(*, cuda: bool = True) -> dict[str, Any]:
    """The states of Python's, NumPy's and torch's global generators (and CUDA's, when in use)."""
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        # as plain values and a tensor, so that weights_only loading reads them back
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def check_rng(state: Any, source: Any) -> None:
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise CheckpointCorruptError(
            f"{source}: the generator states are missing or incomplete; the state cannot be resumed exactly"
        )
    if not isinstance(state["torch"], torch.Tensor) or state["torch"].dtype != torch.uint8:
        raise CheckpointCorruptError(f"{source}: torch's generator state is not a byte tensor")


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": numpy_state["bit_generator"],
            "state": {"key": numpy_state["key"].numpy().astype(np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    saved_cuda = state.get("cuda")
    if saved_cuda and torch.cuda.is_available():
        count = min(len(saved_cuda), torch.cuda.device_count())
        if count < len(saved_cuda):
            log.warning(
                "the state holds %d CUDA generators, this process sees %d GPUs; restoring the first %d",
                len(saved_cuda),
                torch.cuda.device_count(),
                count,
            )
        for index in range(count):
            torch.cuda.set_rng_state(saved_cuda[index], index)


# --- the data position ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchRecord:
    """What the Engine needs to know about the batch a loader just yielded."""

    epoch: int
    index: int  # the global batch's position in its epoch
    rows: int  # rows this process received
    global_rows: int  # rows of the global batch
    loss_weight: float  # turns this process's mean loss into its part of an average over processes


class GlobalBatches(Sampler[list[int]]):
    """The batches of indices of one epoch, from batch `start` on; this process's share of each (`share`).

    Iteration starts eagerly: `iter()` draws the epoch's order at once (so a resumed epoch can redraw it
    inside a window where the generators are set back) and skips `start` batches by index only.
    """

    def __init__(self, batch_sampler: Any, share: Callable[[list[int]], list[int]] = list):
        self.batch_sampler, self.share = batch_sampler, share
        self.start = 0
        self.records: collections.deque[tuple[int, int, int]] = collections.deque()  # (index, rows, global rows)

    def __iter__(self) -> Iterator[list[int]]:
        batches = iter(self.batch_sampler)
        skip, self.start = self.start, 0
        for _ in range(skip):
            if next(batches, None) is None:
                break
        first = next(batches, None)
        return self._shares(first, batches, skip)

    def _shares(self, first: Any, batches: Iterator, index: int) -> Iterator[list[int]]:
        if first is None:
            return
        for batch in itertools.chain([first], batches):
            batch = list(batch)
            share = self.share(batch)
            self.records.append((index, len(share), len(batch)))
            index += 1
            yield share

    def __len__(self) -> int:
        return len(self.batch_sampler)


def _generators(loader: DataLoader, batch_sampler: Any) -> list[torch.Generator]:
    """The torch generators that decide a loader's order (its own, its sampler's), each once."""
    found: dict[int, torch.Generator] = {}
    sampler = getattr(batch_sampler, "sampler", None)
    for owner in (loader, loader.sampler, batch_sampler, sampler):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and generator.device.type == "cpu":
            found.setdefault(id(generator), generator)
    return list(found.values())


def _stateful_samplers(batch_sampler: Any) -> list[Any]:
    samplers = [batch_sampler, getattr(batch_sampler, "sampler", None)]
    return [
        s
        for s in samplers
        if s is not None and callable(getattr(s, "state_dict", None)) and callable(getattr(s, "load_state_dict", None))
    ]


def resumable(loader: Any) -> TypeGuard[DataLoader]:
    """Whether the Engine can track and restore this loader's position (a map-style DataLoader with batches)."""
    return (
        isinstance(loader, DataLoader)
        and not isinstance(loader.dataset, IterableDataset)
        and loader.batch_sampler is not None
    )


class ResumableLoader:
    """A DataLoader's global batches (this process's share of each), with a position that can be saved.

    `rule` is the strategy's data rule (its hooks global_batches, batch_share and loss_weight); without one,
    this process sees every batch whole. `position()` gives the epoch and its next batch (the same in every
    process) and `order_state()` this process's generator states from the epoch's start; after
    `resume_from(position, order_state)`, the next iteration continues that epoch from that batch, in the
    same order. Every other iteration starts a new epoch, as a DataLoader does; samplers with `set_epoch`
    are told the epoch. `last_batch` is the record of the batch yielded last, also handed to `on_batch`.
    """

    def __init__(self, loader: DataLoader, rule: Any = None, *, on_batch: Callable[[BatchRecord], None] | None = None):
        if not resumable(loader):
            raise TypeError(
                "loader: expected a torch DataLoader over a map-style dataset with batch_size= or batch_sampler=, "
                f"got {type(loader).__name__}"
            )
        self.source = loader
        self.rule = rule
        self.on_batch = on_batch
        if rule is None:
            self.global_batches = GlobalBatches(loader.batch_sampler)
        else:
            self.global_batches = GlobalBatches(rule.global_batches(loader), rule.batch_share)
        self.generators = _generators(loader, self.global_batches.batch_sampler)
        extra: dict[str, Any] = (
            {"prefetch_factor": loader.prefetch_factor, "persistent_workers": loader.persistent_workers}
            if loader.num_workers > 0
            else {}
        )
        self.loader = DataLoader(
            loader.dataset,
            batch_sampler=self.global_batches,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator,
            **extra,
        )
        self.epoch = 0  # the epoch the next iteration starts (or, mid-epoch, the one in progress)
        self.next_batch = 0  # the next batch of that epoch
        self.in_epoch = False
        self.epoch_start: dict[str, Any] | None = None  # generator states when the current epoch began
        self._resume: tuple[int, dict[str, Any]] | None = None  # (batch, generator states) for the next iteration
        self.last_batch: BatchRecord | None = None

    # --- what decides an epoch's order ----------------------------------------------------------------
    def _order_state(self) -> dict[str, Any]:
        return {
            "rng": capture_rng(cuda=False),
            "generators": [g.get_state() for g in self.generators],
            "samplers": [s.state_dict() for s in _stateful_samplers(self.global_batches.batch_sampler)],
        }

    def _set_order_state(self, state: dict[str, Any]) -> None:
        restore_rng(state["rng"])
        for generator, saved in zip(self.generators, state["generators"]):
            generator.set_state(saved)
        for sampler, saved in zip(_stateful_samplers(self.global_batches.batch_sampler), state["samplers"]):
            sampler.load_state_dict(saved)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration runs (as DistributedSampler.set_epoch)."""
        self.epoch, self.next_batch, self.in_epoch, self._resume = epoch, 0, False, None

    def _tell_samplers(self, epoch: int) -> None:
        for sampler in (self.global_batches.batch_sampler, getattr(self.global_batches.batch_sampler, "sampler", None)):
            if sampler is not None and callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self.in_epoch and self._resume is None:  # the previous iteration was left early: a new epoch
            self.epoch, self.in_epoch = self.epoch + 1, False
        epoch = self.epoch
        self._tell_samplers(epoch)
        self.global_batches.records.clear()
        resume, self._resume = self._resume, None
        if resume is not None and resume[0] > 0:
            start, order_state = resume
            now = capture_rng(cuda=False)
            self._set_order_state(order_state)  # redraw the epoch's order as it was first drawn
            self.global_batches.start = start
            iterator = iter(self.loader)
            restore_rng(now)  # the global generators continue from the saved state, not from the redraw
            self.epoch_start = order_state
        else:
            start = 0
            self.epoch_start = self._order_state()
            iterator = iter(self.loader)
        self.in_epoch, self.next_batch = True, start
        for batch in iterator:
            index, rows, global_rows = self.global_batches.records.popleft()
            self.next_batch = index + 1
            weight = 1.0 if self.rule is None else self.rule.loss_weight(rows, global_rows)
            self.last_batch = BatchRecord(epoch, index, rows, global_rows, weight)
            if self.on_batch is not None:
                self.on_batch(self.last_batch)
            yield batch
        self.epoch, self.next_batch, self.in_epoch = epoch + 1, 0, False

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # dataset, batch_size, …
        if name in ("source", "loader", "global_batches", "rule", "on_batch"):
            raise AttributeError(name)
        return getattr(self.source, name)

    # --- saving and restoring the position --------------------------------------------------------------
    def position(self) -> dict[str, int]:
        """Shared by every process: the epoch and its next global batch (same under any world size)."""
        return {
            "epoch": self.epoch,
            "next_batch": self.next_batch if self.in_epoch else 0,
            "batches_per_epoch": len(self.global_batches),
            "dataset_size": self._dataset_size(),
        }

    def _dataset_size(self) -> int:
        # a map-style dataset (resumable() checked) has a length; torch's Dataset type does not say so
        return len(self.source.dataset)  # type: ignore[arg-type]

    def order_state(self) -> dict[str, Any] | None:
        """This process's generator states from the start of the epoch in progress (None between epochs)."""
        return self.epoch_start if self.in_epoch else None

    def check_position(self, position: Any, source: str) -> None:
        if not isinstance(position, dict) or not {"epoch", "next_batch", "batches_per_epoch"} <= set(position):
            raise CheckpointCorruptError(f"{source}: the data position is missing or incomplete")
        here = len(self.global_batches)
        size = self._dataset_size()
        if position["batches_per_epoch"] != here or position.get("dataset_size", size) != size:
            raise ValueError(
                f"loader: the state was saved with {position['batches_per_epoch']} batches per epoch over "
                f"{position.get('dataset_size')} samples, this loader has {here} over {size}; "
                "resume with the same dataset and global batch size"
            )

    def resume_from(self, position: dict[str, int], order_state: dict[str, Any] | None) -> None:
        """Continue at `position` on the next iteration (after check_position)."""
        self.epoch, self.next_batch = int(position["epoch"]), int(position["next_batch"])
        self.in_epoch = self.next_batch > 0
        if self.next_batch > 0 and order_state is None:
            raise CheckpointCorruptError(
                "the state stops mid-epoch but holds no generator states for that epoch's order"
            )
        self._resume = (self.next_batch, order_state) if self.next_batch > 0 and order_state is not None else None


# --- the state directory --------------------------------------------------------------------------------


def step_directory_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    """The step a state directory's name gives (None for any other name)."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def _pointer_text(name: str) -> str:
    return f"{name} sha256:{hashlib.sha256(name.encode()).hexdigest()}\n"


def read_latest(root: Path) -> Path | None:
    """The step directory the `latest` pointer names (None without a pointer)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    text = pointer.read_text(errors="replace")
    name = text.split(" ", 1)[0]
    if text != _pointer_text(name) or not _STEP_DIR.match(name):
        raise CheckpointCorruptError(
            f"{pointer}: the pointer to the newest state is damaged; delete it to load the newest step-* directory, "
            "or pass a step directory"
        )
    return root / name


_warned: set[tuple[str, str]] = set()


def _ignore_stray(path: Path, why: str) -> None:
    key = (str(path), why)
    if key not in _warned:  # once per entry: every save lists the folder
        _warned.add(key)
        log.warning("%s: %s, not a saved state; ignoring it (keep never counts or removes it)", path, why)


def step_directories(root: Path) -> list[Path]:
    """The state directories under `root`, oldest first: folders named step-NNNNNNNN that hold something.

    Stray entries are never taken for states, each ignored with a warning: another name starting with
    `step-` (a copy such as step-00000005.bak), a file with a state's name, an empty step folder."""
    found = []
    for path in root.iterdir():
        if not path.name.startswith("step-"):
            continue
        step = step_of(path)
        if step is None:
            _ignore_stray(path, "named unlike a state directory (step-NNNNNNNN)")
        elif not path.is_dir():
            _ignore_stray(path, "a file")
        elif not any(path.iterdir()):
            _ignore_stray(path, "an empty folder")
        else:
            found.append((step, path))
    return [path for _, path in sorted(found)]


def _aside(root: Path, name: str) -> Path:
    """Where a state directory waits while a new save of the same step takes its place."""
    return root / f".{name}.old.tmp"


def _is_one_state(path: Path) -> bool:
    """Whether `path` is one state directory given directly (not a folder of states), complete or not."""
    if not path.is_dir():
        return False
    if (path / STATE_FILE).exists() or (path / SHARDS).exists() or any(path.glob("rank-*.pt")):
        return True
    return step_of(path) is not None


def find_state(directory: str | os.PathLike) -> Path:
    """The step directory to load: `directory` itself if it is one, else the one `latest` names (without a
    pointer, the newest step directory). FileNotFoundError only when `directory` holds no state at all: a
    state that is damaged, or a pointer naming a state that is gone, is a CheckpointCorruptError."""
    directory = Path(directory)
    if _is_one_state(directory):
        return directory  # read_state_directory checks that every file is there
    if not directory.is_dir():
        raise FileNotFoundError(f"directory: no saved state at {directory}")
    chosen = read_latest(directory)
    if chosen is not None:
        if (chosen / STATE_FILE).is_file():
            return chosen
        if (_aside(directory, chosen.name) / STATE_FILE).is_file():
            # a save of the same step was killed between its two renames: the previous copy waits aside
            log.warning(
                "%s: %s was being replaced when a save stopped; loading its previous copy", directory, chosen.name
            )
            return _aside(directory, chosen.name)
        if chosen.is_dir() and any(chosen.iterdir()):
            return chosen  # a damaged state: reading it names what is missing
        left = step_directories(directory)
        raise CheckpointCorruptError(
            f"{directory / LATEST} names {chosen.name}, which is "
            f"{'empty' if chosen.is_dir() else 'gone'}: the newest state was removed or lost, so this folder "
            "does not hold what the last save wrote. "
            + (
                f"To resume from the newest state left, pass {left[-1]} or delete {directory / LATEST} "
                f"(then {left[-1].name} loads)"
                if left
                else f"No other state is left; delete {directory} to start afresh"
            )
        )
    states = step_directories(directory)
    if not states:
        raise FileNotFoundError(
            f"directory: {directory} holds no saved state (no {LATEST} pointer, no step-* directory)"
        )
    return states[-1]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_state_temporaries(root: Path) -> None:
    for aside in root.glob(".step-*.old.tmp"):  # a replaced state whose replacement never arrived: put it back
        final = root / aside.name[1 : -len(".old.tmp")]
        if not final.exists() and (aside / STATE_FILE).is_file():
            os.rename(aside, final)
            log.info("restored %s, which an interrupted save had moved aside", final)
    for stale in itertools.chain(root.glob(".step-*.tmp"), root.glob(f".{LATEST}.*.tmp")):
        _remove(stale)
        log.debug("removed %s, left by an interrupted save", stale)


def _complete_at_a_glance(path: Path) -> bool:
    return (path / STATE_FILE).is_file() and (path / "rank-0.pt").is_file()


def _step_number(path: Path) -> int:
    step = step_of(path)
    if step is None:
        raise ValueError(f"{path}: not a state directory (its name gives no step)")
    return step


def remove_old_states(root: Path, written: Path, keep: int) -> None:
    """Keep the newest `keep` complete states up to `written` (itself included); remove the older ones.

    Stray entries are never counted or removed, a damaged state (a file missing) is not counted, and states
    newer than `written` (left from before the run went back to an earlier state) are left alone."""
    step = _step_number(written)
    older = [path for path in step_directories(root) if path != written and _step_number(path) < step]
    complete = [path for path in older if _complete_at_a_glance(path)]
    kept = complete[max(0, len(complete) - (keep - 1)) :] if keep > 1 else []
    oldest_kept = _step_number(kept[0]) if kept else step
    for path in older:
        if _step_number(path) < oldest_kept:
            _remove(path)
            log.debug("removed %s (keep=%d)", path, keep)


def _raise_write_failure(error: BaseException, path: Path) -> None:
    """Raise a write's failure in one line when it is the storage's (a full disk), else the error itself."""
    failure = os_error_in(error)
    if failure is None or isinstance(error, CheckpointWriteError):
        raise error
    raise write_error(failure, path, "the previous state is intact") from error


def _together(agree: Callable[[Any], list[Any]], action: Callable[[], None]) -> None:
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
    shared: dict[str, Any] | None,
    mine: dict[str, Any],
    *,
    rank: int,
    keep: int | None,
    barrier: Callable[[], None],
    shards: dict[str, Any] | None = None,
    gather: Callable[[Any], list[Any]] | None = None,
) -> Path:
    """Write one state directory; every process calls this (rank 0 passes `shared`). With `shards` (a sharded
    strategy's state, on every process) each process writes its shards into the folder SHARDS through
    torch.distributed.checkpoint, and rank 0 records every shard file's SHA-256 in `shared`.

    All or nothing: a save that fails in any process (a full disk, a write error) raises in every process
    (given `gather`, an all_gather_object; with `barrier` alone only in the process that failed), removes
    what it wrote and leaves the previous states and `latest` as they were."""
    root = Path(root)
    name = step_directory_name(step)
    final, temporary = root / name, root / f".{name}.tmp"
    if root.exists() and not root.is_dir():  # every process checks, so none waits for a rank 0 that failed here
        raise NotADirectoryError(f"directory: {root} is a file; give a folder for the training state")

    def agree_at_barrier(message: Any) -> list[Any]:
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
        if (temporary / SHARDS).is_dir():
            fsync_directory(temporary / SHARDS)
        fsync_directory(temporary)
        if final.exists() or final.is_symlink():  # the same step saved again: move the old one aside, then drop it
            done.replaced = _aside(root, name)
            os.rename(final, done.replaced)
        os.rename(temporary, final)
        done.placed = True
        fsync_directory(root)
        try:
            atomic_write(root / LATEST, lambda handle: handle.write(_pointer_text(name).encode()))
        except BaseException as error:
            _raise_write_failure(error, root / LATEST)
        done.pointed = True
        if done.replaced is not None:
            _remove(done.replaced)
        if keep is not None:
            remove_old_states(root, final, keep)

    try:
        _together(agree, begin)
        if shards is not None:
            try:  # DCP's save is a collective that raises in every process when one fails
                write_shards(shards, temporary / SHARDS)
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
            _remove(final)
        if replaced is not None and replaced.exists() and not final.exists():
            os.rename(replaced, final)
        _remove(temporary)
    except OSError as error:  # the failure being raised matters more; the next save removes what is left
        log.warning("could not remove what the failed save left in %s: %s", temporary.parent, error)


def check_state_files(folder: Path, shared: dict[str, Any]) -> None:
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
    directory: str | os.PathLike, rank: int, *, map_location: Any = "cpu"
) -> tuple[Path, dict[str, Any], dict[str, Any]]:
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
    return chosen, shared, mine


def check_state_format(shared: Any, source: Any) -> None:
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


def check_keep(keep: Any) -> int | None:
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


def kind_of(obj: Any) -> str:
    """An object's class as the state records it ('torch.optim.sgd.SGD')."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def short_kind(kind: str) -> str:
    """The class name of a recorded kind ('SGD')."""
    return kind.rsplit(".", 1)[-1]


def same_kind(saved: Any, here: str) -> bool | None:
    """Whether a recorded kind is `here`'s class, by class name (a class that moved to another module, or ran as
    __main__ when saved, is the same); None when nothing usable was recorded."""
    if not isinstance(saved, str) or not saved:
        return None
    return saved.rsplit(".", 1)[-1] == here.rsplit(".", 1)[-1]
