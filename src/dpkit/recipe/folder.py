"""A recipe run's folder: the files a run leaves there, its lock (one run writes a folder at a time), reading
what an earlier run left (run.json, metrics.json, the saved states), writing JSON whole, best.pt and best.json
rolled back with the state they belong to, and the id of the job a run belongs to (a restarted worker group
continues only the run its own job created).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from dpkit.checkpoint.model_files import atomic_write
from dpkit.checkpoint.steps import step_directories
from dpkit.errors import DpkitError
from dpkit.launch import launched
from dpkit.launch.environment import LAUNCHER_PID_VARIABLE, process_place
from dpkit.recipe.config import BAD_INPUT_EXIT_CODE
from dpkit.recipe.metrics_log import METRICS_CSV, TENSORBOARD_FOLDER

try:  # one writer per run folder: flock (Linux, macOS); without it the folder is not locked
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]  # an optional module: None where there is none

log = logging.getLogger("dpkit")

# what a run leaves in its folder; any of them there means the folder holds a run
RUN_SETTINGS = "run.json"
METRICS = "metrics.json"
MODEL = "model.pt"
BEST_MODEL = "best.pt"
BEST = "best.json"
RUN_FILES = (MODEL, METRICS, RUN_SETTINGS, METRICS_CSV, BEST_MODEL, BEST)
STATE_FOLDER = "state"
# held by the one run writing the folder (flock); not part of a run, never removed by overwrite
LOCK_FILE = ".dpkit-train.lock"
# set by `run` for the processes it starts: the job's id (its restarted groups continue the run it created), and
# the run folder whose lock `run` holds for them
JOB_VARIABLE = "DPKIT_TRAIN_JOB"
LOCKED_VARIABLE = "DPKIT_TRAIN_LOCKED"


class FolderInUse(DpkitError):
    """Another run holds the run folder's lock: one run writes a folder at a time."""

    exit_code = BAD_INPUT_EXIT_CODE


# --- one writer per run folder ------------------------------------------------------------------------


class FolderLock:
    """An exclusive flock on OUT/.dpkit-train.lock, which holds the holder's pid and host. The kernel releases
    it when the holder dies, however it dies; the next run takes it then. Folders this lock created to hold the
    file are removed on release if they are still empty (a refused run leaves nothing behind)."""

    def __init__(self, out: Path):
        self.out = out
        self.path = out / LOCK_FILE
        self.fd: int | None = None
        self.created: list[Path] = []

    def take(self) -> FolderLock:
        missing = []
        for folder in (self.out, *self.out.parents):
            if folder.exists():
                break
            missing.append(folder)
        for folder in reversed(missing):
            try:
                folder.mkdir()
                self.created.append(folder)
            except FileExistsError:
                pass
            except OSError as error:
                self._undo_folders()
                raise not_writable(self.out, error) from None
        try:
            for _ in range(100):
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
                except OSError as error:
                    raise not_writable(self.out, error) from None
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.read(fd, 200).decode(errors="replace").strip()
                    os.close(fd)
                    raise FolderInUse(
                        f"out: {str(self.out)!r} is in use by another run ({holder or 'its pid is not written yet'}); "
                        "one run writes a folder at a time: wait for it to end, or choose another folder"
                    ) from None
                except OSError as error:  # a filesystem without locks (some network and FUSE mounts)
                    log.warning("%s: cannot lock (%s); nothing keeps a second run out of this folder", self.path, error)
                    os.close(fd)
                    self._forget()
                    return self
                # the last holder removes the file as it releases it: lock the file that is there now
                try:
                    here, there = os.fstat(fd), os.stat(self.path)
                    same = (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
                except FileNotFoundError:
                    same = False
                if same:
                    self.fd = fd
                    break
                os.close(fd)
            else:  # pragma: no cover - a folder whose lock file is replaced a hundred times in a row
                raise FolderInUse(f"out: {str(self.out)!r}: could not lock {LOCK_FILE}; try again")
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        except BaseException:
            self._undo_folders()
            raise
        return self

    def _forget(self) -> None:
        """Not locked after all: remove the file this lock made, keep the folders (the run writes there)."""
        with contextlib.suppress(OSError):
            if self.path.stat().st_size == 0:
                self.path.unlink()
        self.created = []

    def release(self) -> None:
        if self.fd is None:
            self._undo_folders()
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while holding it: a run that opened it meanwhile sees it is gone and retries
        os.close(self.fd)
        self.fd = None
        self._undo_folders()

    def _undo_folders(self) -> None:
        for folder in reversed(self.created):
            try:
                folder.rmdir()
            except OSError:
                break
        self.created = []


def not_writable(out: Path, error: OSError) -> ValueError:
    return ValueError(
        f"out: {str(out)!r} is not writable ({error.strerror or error}); choose a folder you can write to"
    )


def check_writable(folder: Path, out: Path, what: str) -> None:
    """Write and remove a file in `folder`: permissions, a read-only mount and an immutable folder all show."""
    try:
        fd, name = tempfile.mkstemp(prefix=".dpkit-write-test.", dir=folder)
    except OSError as error:
        raise ValueError(
            f"out: {str(folder)!r} is not writable ({error.strerror or error}); the run writes {what} there: make "
            f"it writable, or choose another folder than {str(out)!r}"
        ) from None
    os.close(fd)
    os.unlink(name)


def lock_holder(out: str | os.PathLike) -> bool:
    """Whether this process takes the run folder's lock: a process on its own, or rank 0 of launched workers
    unless the process that started them (`run`) holds it for them."""
    if fcntl is None:
        return False
    if not launched():
        return True
    if os.environ.get(LOCKED_VARIABLE) == str(Path(out).absolute()):
        return False
    return process_place().is_first


# --- who is running: a restarted worker group continues only its own job's run --------------------------


def process_start(pid: int) -> str:
    """When process `pid` started (boot id and clock ticks since boot): with the pid, it names the process."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return f"{boot}:{fields[19]}"
    except (OSError, IndexError):
        return "unknown"


def job_id() -> str:
    """The same string in every attempt of one job, another in the next job.

    The process that started the workers sets it for them (`run` does: DPKIT_TRAIN_JOB); else, under a
    launcher, the launcher process names the job: host, pid and start time (restarts keep it, a new launch
    changes it). A process on its own gets a fresh id (it is never restarted)."""
    given = os.environ.get(JOB_VARIABLE)
    if given:
        return given
    if launched():
        pid = int(os.environ.get(LAUNCHER_PID_VARIABLE) or os.getppid())
        return f"launcher on {socket.gethostname()}, pid {pid}, started {process_start(pid)}"
    return f"process {uuid.uuid4().hex}"


# --- what an earlier run left ----------------------------------------------------------------------------


def saved_states(out: Path) -> list[Path]:
    """The saved states under OUT/state, oldest first."""
    folder = out / STATE_FOLDER
    if not folder.is_dir():
        return []
    return step_directories(folder)  # stray entries (a .bak copy, an empty step folder) ignored with a warning


def read_settings(out: Path) -> dict[str, Any] | None:
    """run.json (None when there is none); a damaged one is an error naming it."""
    path = out / RUN_SETTINGS
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(
            f"out: {str(path)!r} is damaged ({error}); restore it, or delete it and the settings are checked "
            "against the saved state"
        ) from None
    if not isinstance(saved, dict):
        raise ValueError(
            f"out: {str(path)!r} is damaged (it holds a {type(saved).__name__}, expected the run's settings as a "
            "JSON object); restore it, or delete it and the settings are checked against the saved state"
        )
    return saved


def read_metrics(out: Path) -> dict[str, Any] | None:
    path = out / METRICS
    if not path.is_file():
        return None
    try:
        metrics = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        log.warning("%s is damaged (%s); the run counts as not finished", path, error)
        return None
    return metrics if isinstance(metrics, dict) else None


def newest_state(out: Path) -> Path | None:
    states = saved_states(out)
    return states[-1] if states else None


def is_finished(out: Path, steps: int, taken: int | None) -> bool:
    """Whether the run in `out` is finished as asked: model and metrics written, its `steps` reached (and no
    state past them)."""
    metrics = read_metrics(out)
    return (
        metrics is not None
        and (out / MODEL).is_file()
        and metrics.get("steps") == steps
        and len(metrics.get("loss") or ()) == steps
        and (taken is None or taken == steps)
    )


# --- writing ---------------------------------------------------------------------------------------------


def remove_run(out: Path) -> None:
    """overwrite=True: only what a run writes goes, nothing else the folder holds."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for folder in (STATE_FOLDER, TENSORBOARD_FOLDER):
        shutil.rmtree(out / folder, ignore_errors=True)


def write_json(path: Path, value: Any) -> None:
    """JSON written whole or not at all (a temporary file renamed over `path`); allow_nan=False: a nan that
    slipped through is an error here, never invalid JSON on disk."""
    text = json.dumps(value, indent=2, allow_nan=False) + "\n"
    atomic_write(path, lambda handle: handle.write(text.encode()))


def best_files(out: Path) -> dict[str, torch.Tensor]:
    """best.pt and best.json's bytes (those that exist), for the saved state."""
    return {
        name: torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for name in (BEST_MODEL, BEST)
        if (out / name).is_file() and (data := (out / name).read_bytes())
    }


def writing(data: bytes) -> Callable[[BinaryIO], int]:
    """What atomic_write calls to write `data`."""
    return lambda handle: handle.write(data)


def restore_best_files(out: Path, saved: dict[str, torch.Tensor] | None) -> None:
    """best.pt and best.json back to what they were when the state was saved: each written whole (or removed
    when the state had none), best.json out first and in last, so a best.json always describes its best.pt."""
    saved_bytes = {name: bytes(data.numpy()) for name, data in (saved or {}).items()}
    on_disk = {name: (out / name).read_bytes() for name in (BEST_MODEL, BEST) if (out / name).is_file()}
    if on_disk == saved_bytes:
        return  # nothing was written after the state: the common case
    (out / BEST).unlink(missing_ok=True)
    for name in (BEST_MODEL, BEST):
        if name in saved_bytes:
            atomic_write(out / name, writing(saved_bytes[name]))
        else:
            (out / name).unlink(missing_ok=True)


def say_finished(out: Path, steps: int) -> dict[str, Any] | None:
    """resume=True on a finished run: said in one line; its metrics."""
    print(
        f"dpkit train: the run in {out} is already finished ({steps} steps; {out / MODEL} and {out / METRICS} are "
        "written); nothing to do",
        flush=True,
    )
    return read_metrics(out)
