"""Saves that do not stop training: `engine.save_state(directory, blocking=False)`.

The save's state is staged on the training thread (every tensor copied: what the loop goes on changing is not what
is written) and written by one background thread, all or nothing as every save (checkpoint/writes.py: a temporary
folder, fsynced, renamed, then `latest` moved). At most one save is in flight: the next save, engine.load_state,
engine.close() and the process's exit wait for it; a write that failed (a full disk, a permission) is raised then,
in the training loop, with the path and the cause, never lost in a thread. Host memory for it is one staged copy
of the state (the model, the optimizers' state, the generators and loaders' positions).

Processes that write together agree through collectives (a barrier, an all_gather_object); from the writing
thread those go through a process group of their own (gloo, made once by every process at the first background
save), so that they never interleave with the training's collectives on the default group, and they stay out of
the collective record, whose numbering must be the same in every process at every step.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from dpkit.engine.resume.save import StagedState
from dpkit.observe.collectives import RECORD

log = logging.getLogger("dpkit")


class SaveHandle:
    """A save under way in the background: `done()`, and `wait()`, which returns the step directory written or
    raises what the write raised."""

    def __init__(self, staged: StagedState, write: Callable[[StagedState], Path], staged_seconds: float):
        self.staged = staged
        self.staged_seconds = staged_seconds  # how long the loop was held staging it
        self._write = write
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"dpkit-save-step-{staged.step}", daemon=True)
        self._thread.start()
        _IN_FLIGHT.add(self)

    def _run(self) -> None:
        try:
            with RECORD.unrecorded():
                self._result = self._write(self.staged)
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

    @property
    def step(self) -> int:
        return self.staged.step


_IN_FLIGHT: weakref.WeakSet[SaveHandle] = weakref.WeakSet()


@atexit.register
def _finish_saves_in_flight() -> None:
    """A process that ends with a save in flight writes it first (all or nothing either way)."""
    for handle in list(_IN_FLIGHT):
        try:
            handle.wait()
        except BaseException as error:  # the process is ending: say it, the previous state is intact
            log.error("the background save of step %d failed at exit: %s", handle.step, error)


class BackgroundSaves:
    """The Engine's saves in the background: the one in flight, and what the loop was held by saves in all."""

    def __init__(self) -> None:
        self.in_flight: SaveHandle | None = None
        self.blocking_seconds = 0.0  # the time the loop was held by saves (staging, and waiting for the last)
        self.saves = 0

    def finish(self) -> Path | None:
        """Wait for the save in flight, if any: its step directory, or its error raised here."""
        handle, self.in_flight = self.in_flight, None
        if handle is None:
            return None
        began = time.perf_counter()
        try:
            return handle.wait()
        finally:
            self.blocking_seconds += time.perf_counter() - began

    def start(self, stage: Callable[[], StagedState], write: Callable[[StagedState], Path]) -> SaveHandle:
        """Stage the state now (the loop waits for that) and write it in the background."""
        self.finish()
        began = time.perf_counter()
        staged = stage()
        seconds = time.perf_counter() - began
        self.blocking_seconds += seconds
        self.saves += 1
        self.in_flight = SaveHandle(staged, write, seconds)
        return self.in_flight

    def blocking(self, save: Callable[[], Path]) -> Path:
        """A save that holds the loop until written (after the one in flight)."""
        self.finish()
        began = time.perf_counter()
        try:
            return save()
        finally:
            self.blocking_seconds += time.perf_counter() - began
            self.saves += 1
