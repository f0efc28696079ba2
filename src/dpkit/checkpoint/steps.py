"""Where training states are: step directory names, the folder's `latest` pointer, finding the state to load.

A state is a directory `step-NNNNNNNN/` under the folder the user names; `latest` names the newest
complete one (with a checksum of its own text). Stray `step-*` entries (step-00000005.bak, a file, an
empty folder) are never states: ignored with a warning, never counted or removed by `keep`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from pathlib import Path

from dpkit.checkpoint.errors import CheckpointCorruptError
from dpkit.checkpoint.shards import SHARDS

log = logging.getLogger("dpkit")

STATE_FORMAT = "dpkit-state/1"
STATE_FILE = "state.pt"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def step_directory_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    """The step a state directory's name gives (None for any other name)."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def pointer_text(name: str) -> str:
    return f"{name} sha256:{hashlib.sha256(name.encode()).hexdigest()}\n"


def read_latest(root: Path) -> Path | None:
    """The step directory the `latest` pointer names (None without a pointer)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    text = pointer.read_text(errors="replace")
    name = text.split(" ", 1)[0]
    if text != pointer_text(name) or not _STEP_DIR.match(name):
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


def aside_path(root: Path, name: str) -> Path:
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
        if (aside_path(directory, chosen.name) / STATE_FILE).is_file():
            # a save of the same step was killed between its two renames: the previous copy waits aside
            log.warning(
                "%s: %s was being replaced when a save stopped; loading its previous copy", directory, chosen.name
            )
            return aside_path(directory, chosen.name)
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


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def complete_at_a_glance(path: Path) -> bool:
    return (path / STATE_FILE).is_file() and (path / "rank-0.pt").is_file()


def step_number(path: Path) -> int:
    step = step_of(path)
    if step is None:
        raise ValueError(f"{path}: not a state directory (its name gives no step)")
    return step
