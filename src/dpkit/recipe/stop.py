"""Stopping a recipe run at a step boundary: SIGINT, SIGTERM and SIGHUP ask the run to stop after the current
step (or in the final evaluation) and save, and the one line said after a stop (what was saved, how to resume).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from dpkit.checkpoint.steps import step_of
from dpkit.recipe.config import TrainConfig
from dpkit.recipe.folder import newest_state

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class StopRequest:
    """SIGINT/SIGTERM/SIGHUP ask the run to stop at the next boundary (after the current step, or in the final
    evaluation) and save, with checkpoint_every; a second Ctrl-C stops at once."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        saved = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
        for signum in saved:
            signal.signal(signum, self._handle)
        try:
            yield self
        finally:
            for signum, handler in saved.items():
                signal.signal(signum, handler)


def stopped_message_after(config: TrainConfig, signum: int, before: Path | None) -> str:
    """The stop line of the process that started the workers: a state newer than `before` is theirs."""
    newest = newest_state(Path(config.out))
    saved = newest if newest is not None and newest != before else None
    return stopped_message(config, signum, None, saved, newest)


def stopped_message(
    config: TrainConfig, signum: int, step: int | None, saved: Path | None, newest: Path | None, during: str = ""
) -> str:
    name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
    at = f" at step {step} of {config.steps}" if step is not None else ""
    at += f", {during}" if during else ""
    resume = config.resume_command or "the same training with resume=True"
    if saved is not None:
        return f"stopped by {name}{at}; state saved in {saved}; resume with: {resume}"
    how = "checkpoint_every=K" if config.checkpoint_every is None else f"a state every {config.checkpoint_every} steps"
    if newest is not None:  # a state from before this run (a resumed run without checkpoint_every saves none)
        unsaved = f"this run saved no state ({how} saves state to resume from); " if not config.checkpoint_every else ""
        return (
            f"stopped by {name}{at}; {unsaved}the newest state is {newest} (step {step_of(newest)}); resume from it "
            f"with: {resume}"
        )
    return f"stopped by {name}{at}; nothing saved yet ({how} saves state to resume from)"
