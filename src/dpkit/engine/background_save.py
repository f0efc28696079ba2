"""Saves that do not stop training: `engine.save_state(directory, blocking=False)`.

The save's state is staged on the training thread (every tensor copied: what the loop goes on changing is not what
is written) and written by one background thread, all or nothing as every save (checkpoint/writes.py: a temporary
folder, fsynced, renamed, then `latest` moved). At most one save is in flight: the next save, engine.load_state,
engine.close() and the process's exit wait for it; a write that failed (a full disk, a permission) is raised then,
in the training loop, with the path and the cause, never lost in a thread. Host memory for it is one staged copy
of the state (the model, the optimizers' state, the generators and loaders' positions; a sharded strategy's
processes each copy their shards), in host memory whatever the device.

A save can be given up (a second Ctrl-C in `dpkit train`: recipe/run.py): its commit (the rename and the move of
`latest`) is then never made, or was made whole before abandon() returns, so the newest state on disk is
decided the moment abandon() returns.

Processes that write together agree through collectives (a barrier, an all_gather_object); from the writing
thread those go through a process group of their own (gloo, made once by every process at the first background
save), so that they never interleave with the training's collectives on the default group, and they stay out of
the collective record, whose numbering must be the same in every process at every step.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from dpkit.engine.resume.save import StagedState, save_training_state, stage_training_state, write_staged_state
from dpkit.engine.wrappers import SetUp
from dpkit.launch.worker import before_worker_exit
from dpkit.observe.collectives import RECORD

log = logging.getLogger("dpkit")


class SaveAbandoned(RuntimeError):
    """A background save abandoned before its commit (nothing of it was committed)."""


class CommitGate:
    """Entered around a background save's commit; abandon() makes a commit not yet begun raise SaveAbandoned
    instead, and waits for one under way to finish."""

    def __init__(self, step: int):
        self.step = step
        self.abandoned = False
        self.committed = False  # the rename and `latest` made (in the process that commits: rank 0)
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()
        if self.abandoned:
            self._lock.release()
            raise SaveAbandoned(f"the background save of step {self.step} was abandoned before its commit")

    def __exit__(self, error_type: type[BaseException] | None, *rest: object) -> None:
        self.committed = error_type is None
        self._lock.release()

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True


class SaveHandle:
    """A save under way in the background: `done()`, and `wait()`, which returns the step directory written or
    raises what the write raised."""

    def __init__(self, staged: StagedState, write: Callable[[StagedState, CommitGate], Path], staged_seconds: float):
        self.staged = staged
        self.staged_seconds = staged_seconds  # how long the loop was held staging it
        self.gate = CommitGate(staged.step)
        self._write = write
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"dpkit-save-step-{staged.step}", daemon=True)
        self._thread.start()
        _IN_FLIGHT.add(self)

    def _run(self) -> None:
        try:
            with RECORD.unrecorded():
                self._result = self._write(self.staged, self.gate)
        except BaseException as error:  # raised in the training loop by wait()
            self._error = error
        finally:
            self.staged = StagedState(self.staged.directory, self.staged.step, None, {}, None, None, 0, False)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the save is written; the step directory, or the write's error (with its path and cause)."""
        self._thread.join()
        _IN_FLIGHT.discard(self)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        assert self._result is not None  # (written: no error)
        return self._result

    def abandon(self) -> bool:
        """Give the save up unless its commit is made already (then it is whole on return): whether it was given
        up. The writing thread may go on writing its temporary files, which the next save removes."""
        self.gate.abandon()
        _IN_FLIGHT.discard(self)
        return not self.gate.committed

    @property
    def step(self) -> int:
        return self.staged.step


_IN_FLIGHT: weakref.WeakSet[SaveHandle] = weakref.WeakSet()


def _finish_saves_in_flight() -> None:
    """A process that ends with a save in flight writes it first (all or nothing either way): at exit, and before a
    launched worker leaves without the atexit handlers (dpkit.launch.worker.exit_worker)."""
    for handle in list(_IN_FLIGHT):
        try:
            handle.wait()
        except BaseException as error:  # the process is ending: say it, the previous state is intact
            log.error("the background save of step %d failed at exit: %s", handle.step, error)


atexit.register(_finish_saves_in_flight)
before_worker_exit(_finish_saves_in_flight)


class BackgroundSaves:
    """The Engine's saves in the background: the one in flight, and what the loop was held by saves in all."""

    def __init__(self) -> None:
        self.in_flight: SaveHandle | None = None
        self.blocking_seconds = 0.0  # the time the loop was held by saves (staging, and waiting for the last)
        self.saves = 0

    def finish(self) -> Path | None:
        """Wait for the save in flight, if any: its step directory, or its error raised here."""
        handle = self.in_flight
        if handle is None:
            return None
        began = time.perf_counter()
        try:
            return handle.wait()
        finally:  # (a Ctrl-C that interrupts the wait leaves it in flight, for abandon())
            if handle.done():
                self.in_flight = None
            self.blocking_seconds += time.perf_counter() - began

    def abandon(self) -> int | None:
        """Give up the save in flight unless it is committed already: the step given up, or None."""
        handle, self.in_flight = self.in_flight, None
        if handle is None or not handle.abandon():
            return None
        return handle.step

    def start(self, stage: Callable[[], StagedState], write: Callable[[StagedState, CommitGate], Path]) -> SaveHandle:
        """Stage the state now (the loop waits for that) and write it in the background."""
        self.finish()
        began = time.perf_counter()
        staged = stage()
        seconds = time.perf_counter() - began
        self.blocking_seconds += seconds
        self.saves += 1
        self.in_flight = SaveHandle(staged, write, seconds)
        return self.in_flight

    def save(self, set_up: SetUp, directory: str | os.PathLike, *, keep: int | None, extra: dict, blocking: bool):
        """engine.save_state's work: written now, or staged now and written in the background (every process)."""
        if blocking:
            return self.blocking(lambda: save_training_state(set_up, directory, keep=keep, extra=extra))
        collectives = set_up.strategy.background_collectives()

        def write(staged: StagedState, gate: CommitGate) -> Path:
            return write_staged_state(
                staged,
                barrier=collectives.barrier,
                gather=collectives.gather,
                shard_group=collectives.group,
                committing=gate,
            )

        return self.start(lambda: stage_training_state(set_up, directory, keep=keep, extra=extra, copy=True), write)

    def blocking(self, save: Callable[[], Path]) -> Path:
        """A save that holds the loop until written (after the one in flight)."""
        self.finish()
        began = time.perf_counter()
        try:
            return save()
        finally:
            self.blocking_seconds += time.perf_counter() - began
            self.saves += 1
