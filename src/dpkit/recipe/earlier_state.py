"""Resuming from a chosen state of the run (resume_from, `--resume-from STEP_DIR`), and the next step a damaged
state's error names: the command that resumes from the newest complete state before it.

Going back leaves the later states where they are: nothing is removed, `latest` moves when this run saves, and a
save of a step that is already there replaces it (as every save does, all or nothing).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from dpkit.checkpoint.errors import CheckpointCorruptError
from dpkit.checkpoint.steps import complete_at_a_glance, find_state, step_directories, step_of
from dpkit.recipe.config import TrainConfig
from dpkit.recipe.folder import STATE_FOLDER

# the generic next step a damaged state's message ends with (dpkit.checkpoint), replaced by a working command
_GENERIC_NEXT_STEP = re.compile(
    r"(?P<lead>[:;,] )?(restore it from a backup, )?or load an earlier (state|checkpoint)( by passing its step "
    r"directory)?$"
)


def check_resume_from(config: TrainConfig) -> None:
    """resume_from names a step directory of this run's state folder (OUT/state/step-N) holding a state."""
    if config.resume_from is None:
        return
    given, folder = Path(config.resume_from), Path(config.out) / STATE_FOLDER
    states = step_directories(folder) if folder.is_dir() else []
    if config.overwrite:
        raise ValueError("resume_from/overwrite: give one: resume_from continues the run from that state")
    if given.is_dir() and step_of(given) is not None and given.resolve().parent == folder.resolve():
        return
    there = (
        f"it holds {', '.join(state.name for state in states)}"
        if states
        else "it holds no saved state"
        if folder.is_dir()
        else "there is no such folder"
    )
    raise ValueError(
        f"resume_from: {str(given)!r} is not a step directory of this run's state folder {str(folder)!r} ({there}); "
        f"pass one of its step-* directories, e.g. {str(states[-1]) if states else str(folder / 'step-00000010')!r}"
    )


def resume_source(config: TrainConfig) -> Path:
    """What the run loads: the chosen step directory, or the state folder (its `latest`)."""
    return Path(config.resume_from) if config.resume_from is not None else Path(config.out) / STATE_FOLDER


def with_earlier_state(error: CheckpointCorruptError, config: TrainConfig) -> CheckpointCorruptError:
    """`error` (a damaged state met on resume) ending with the step that works: the command that resumes from the
    newest complete state before the damaged one, or that none is left."""
    folder = Path(config.out) / STATE_FOLDER
    try:
        damaged_step = step_of(find_state(resume_source(config)))
    except (OSError, CheckpointCorruptError):
        damaged_step = None
    earlier = [
        state
        for state in (step_directories(folder) if folder.is_dir() else [])
        if (damaged_step is None or (step_of(state) or 0) < damaged_step) and complete_at_a_glance(state)
    ]
    if earlier:
        next_step = (
            f"resume from the state before it ({earlier[-1].name}) with: {_resume_from_command(config, earlier[-1])}"
        )
    else:
        next_step = (
            f"no complete state before it is left in {folder}: restore it from a backup, or start the run afresh "
            + ("with --overwrite" if config.resume_command else "with overwrite=True")
        )
    message = str(error)
    generic = _GENERIC_NEXT_STEP.search(message)
    if generic:
        message = message[: generic.start()] + "; "
    else:
        message += "; "
    return type(error)(message + next_step)


def _resume_from_command(config: TrainConfig, state: Path) -> str:
    """The command (or argument) that resumes this run from `state`."""
    if not config.resume_command:
        return f"resume_from={str(state)!r}"
    words, kept = shlex.split(config.resume_command), []
    skip = False
    for word in words:  # this run's own --resume-from, if it had one, gives way to the earlier state
        if skip:
            skip = False
        elif word == "--resume-from":
            skip = True
        elif not word.startswith("--resume-from="):
            kept.append(word)
    return shlex.join([*kept, "--resume-from", str(state)])
