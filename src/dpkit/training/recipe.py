"""The training recipe behind `dpkit train`, as library code: train an example (or your model and data) with
any strategy, then write model.pt, metrics.json and run.json into a folder.

    from dpkit.training.recipe import TrainConfig, run
    run(TrainConfig(example="digits", strategy="replicated", accelerator="cpu", devices=2, steps=20, out="runs/r"))

The same seed gives the same initial weights and the same global batches whatever the strategy, so
model.pt from every strategy is the same model up to float rounding. A strategy with one process per device
(ddp) needs its processes: under a launcher (`dpkit launch`) the recipe runs in each; without one, `run`
starts them itself when the config says how to run this same training again (`relaunch`, which `dpkit
train` fills in with its own command line), and waits for them.

Faults: every setting is checked before any work starts, a folder holding a run is never overwritten
without overwrite=True (and only once every process passed its checks), one run writes a folder at a time
(a lock in the folder), checkpoint_every=K saves the resumable state every K steps and when SIGINT, SIGTERM
or SIGHUP arrives, resume=True continues from it (or completes a run stopped at its end, or says that a
finished run is finished), a loss that becomes nan/inf stops the run (TrainingDiverged), and under
`dpkit launch --max-restarts` a restarted worker group checks everything the first attempt checked and
resumes only the run its own job created.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from dpkit.checks import (
    check_batch_split,
    check_int,
    check_last_batch,
    check_number,
    check_output_folder,
    check_seed,
)
from dpkit.devices import available_cores, check_process_count, resolve_devices
from dpkit.errors import DpkitError
from dpkit.launch import Command, LaunchError, StoppedBySignal, launched, relaunch, relaunched, restart_count
from dpkit.launch.environment import LAUNCHER_PID_VARIABLE
from dpkit.plan.auto import choose_strategy
from dpkit.precision import PRECISIONS, Precision
from dpkit.strategies import PER_DEVICE, available_strategies, strategy_class
from dpkit.training.checkpoint import atomic_write
from dpkit.training.engine import Engine
from dpkit.training.evaluation import Best, Scores, evaluate
from dpkit.training.metrics_log import METRICS_CSV, TENSORBOARD_FOLDER, MetricsLog, tensorboard_writer_class
from dpkit.training.optimization import OPTIMIZERS, SCHEDULES, build_optimizer, schedule_at
from dpkit.training.sources import check_model_fits, model_source
from dpkit.training.state import read_state_directory, step_directories, step_of

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
# settings a resumed run must share with the run it continues
RESUME_MUST_MATCH = (
    "example",
    "model",
    "data",
    "seed",
    "batch_size",
    "accumulate",
    "optimizer",
    "momentum",
    "weight_decay",
)
# settings a resumed run may change when it says so (change=...), recorded in run.json; `steps` changes freely
# with a constant schedule and needs saying with a cosine one (it moves the curve)
CHANGEABLE = ("lr", "schedule", "lr_warmup_steps", "clip_grad_norm", "steps")
# what keep_best keeps the best model by: metric -> whether larger is better
BEST_BY = {"accuracy": True, "loss": False}
DIVERGED_EXIT_CODE = 3
BAD_INPUT_EXIT_CODE = 2
# set by `run` for the processes it starts: the job's id (its restarted groups continue the run it created), and
# the run folder whose lock `run` holds for them
JOB_VARIABLE = "DPKIT_TRAIN_JOB"
LOCKED_VARIABLE = "DPKIT_TRAIN_LOCKED"
# the strategy strategy="auto" chose, for the processes the run starts
AUTO_VARIABLE = "DPKIT_TRAIN_AUTO"
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class TrainingDiverged(DpkitError):
    """The loss became nan or inf; training stopped before writing anything from it."""

    exit_code = DIVERGED_EXIT_CODE


class FolderInUse(DpkitError):
    """Another run holds the run folder's lock: one run writes a folder at a time."""

    exit_code = BAD_INPUT_EXIT_CODE


@dataclass
class TrainConfig:
    """Everything a training run is, as plain values. `devices`: a count, a list ("cpu:0", 1, …) or "auto"."""

    example: str | None = "digits"  # the data and model; your `model` and `data` replace either
    model: str | None = None  # 'package.module:factory'
    data: str | None = None  # 'package.module:loader', loader(seed) -> x_train, y_train, x_test, y_test
    strategy: str = "single"
    accelerator: str = "auto"
    devices: Any = "auto"
    steps: int = 100  # optimizer steps in total, a resumed run's included
    batch_size: int = 64  # the global batch, split across devices
    batch_size_per_device: int | None = None  # instead of batch_size: the global batch is this times the devices
    seed: int = 0
    optimizer: str = "sgd"  # sgd, adamw or adam
    lr: float = 0.1  # the peak learning rate with a schedule
    momentum: float = 0.0  # sgd
    weight_decay: float = 0.0
    schedule: str = "constant"  # or "cosine": decays to 0 at the last step
    lr_warmup_steps: int = 0  # linear warm-up to lr over these first steps
    clip_grad_norm: float | None = None  # clip the gradients' global norm to this before each step
    precision: str = "32"
    accumulate: int = 1
    out: str = "runs/train"
    checkpoint_every: int | None = None
    keep: int = 2
    eval_every: int | None = None  # evaluate on the test data every K steps (and at the end)
    keep_best: str | None = None  # "accuracy" or "loss": keep OUT/best.pt, the best model by that evaluation metric
    log_every: int = 10  # write the steps' metrics to OUT/metrics.csv every K steps (rows per step)
    tensorboard: bool = False  # also write them to TensorBoard in OUT/tensorboard
    resume: bool = False
    change: Any = ()  # with resume: the settings of CHANGEABLE the resumed run changes, e.g. ("lr",) or "lr,schedule"
    overwrite: bool = False
    max_restarts: int = 0  # with processes started by `run` itself
    hang_timeout_seconds: float | None = None  # with processes started by `run` itself
    force: bool = False  # start more processes than a sane multiple of the cores
    progress: bool = True
    # how to run this same training again, once per device, where the strategy needs a process per device
    relaunch: Command | None = field(default=None, compare=False)
    resume_command: str | None = None  # what a person runs to resume this run (said after a stop)

    def settings(self) -> dict[str, Any]:
        """What run.json records: what decides the model a run ends with."""
        return {
            "example": None if (self.model and self.data) else self.example,
            "model": self.model,
            "data": self.data,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "accumulate": self.accumulate,
            "optimizer": self.optimizer,
            "lr": self.lr,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "schedule": self.schedule,
            "lr_warmup_steps": self.lr_warmup_steps,
            "clip_grad_norm": self.clip_grad_norm,
            "steps": self.steps,
        }

    def changes(self) -> tuple[str, ...]:
        """`change` as names: ("lr",) from "lr", ["lr"] or ("lr",)."""
        names = self.change.split(",") if isinstance(self.change, str) else list(self.change or ())
        return tuple(str(name).strip().replace("-", "_") for name in names if str(name).strip())


@dataclass(frozen=True)
class Plan:
    """What the run does with its folder, decided once by the process that checks the folder (the only one,
    or rank 0 under a launcher) and told to the others."""

    job: str  # who is running: recorded in run.json by the run that creates it
    changes: tuple = ()  # run.json's record of the settings changed on resume: ({"step", "setting", "from", "to"}, …)
    resume: bool = False  # continue from the newest state in OUT/state
    remove: bool = False  # overwrite: remove the old run once every process has passed every check
    finished: bool = False  # resume=True on a run that is already finished: nothing to do


@dataclass
class Prepared:
    """What the checks produced, so nothing is built twice: the model, the data, the plan for the folder (None
    in a process that leaves the folder to rank 0) and the folder's lock (held by one process of a run)."""

    model: nn.Module
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    plan: Plan | None
    lock: FolderLock | None = None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def run(config: TrainConfig) -> dict[str, Any] | None:
    """Check, then train (starting one process per device first where the strategy needs it). Returns the
    metrics written (None on the ranks other than 0); for a finished run given resume=True, its metrics."""
    config = resolve_batch(config)
    config = resolve_auto(config)
    prepared = prepare(config)
    try:
        if prepared.plan is not None and prepared.plan.finished and not launched():
            return _say_finished(config)
        if strategy_class(config.strategy).needs_launcher():
            return run_processes(config, prepared)
        return train(config, prepared)
    finally:
        prepared.release()


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
                raise _not_writable(self.out, error) from None
        try:
            for _ in range(100):
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
                except OSError as error:
                    raise _not_writable(self.out, error) from None
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


def _not_writable(out: Path, error: OSError) -> ValueError:
    return ValueError(
        f"out: {str(out)!r} is not writable ({error.strerror or error}); choose a folder you can write to"
    )


def _check_writable(folder: Path, out: Path, what: str) -> None:
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


def _lock_holder(config: TrainConfig) -> bool:
    """Whether this process takes the run folder's lock: a process on its own, or rank 0 of launched workers
    unless the process that started them (`run`) holds it for them."""
    if fcntl is None:
        return False
    if not launched():
        return True
    if os.environ.get(LOCKED_VARIABLE) == str(Path(config.out).absolute()):
        return False
    return os.environ.get("RANK") == "0"


# --- who is running: a restarted worker group continues only its own job's run --------------------------


def _process_start(pid: int) -> str:
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
        return f"launcher on {socket.gethostname()}, pid {pid}, started {_process_start(pid)}"
    return f"process {uuid.uuid4().hex}"


# --- checks, all before any work ----------------------------------------------------------------------


def saved_states(out: Path) -> list[Path]:
    """The saved states under OUT/state, oldest first."""
    folder = out / STATE_FOLDER
    if not folder.is_dir():
        return []
    return step_directories(folder)  # stray entries (a .bak copy, an empty step folder) ignored with a warning


def _read_settings(out: Path) -> dict[str, Any] | None:
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


def _read_metrics(out: Path) -> dict[str, Any] | None:
    path = out / METRICS
    if not path.is_file():
        return None
    try:
        metrics = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        log.warning("%s is damaged (%s); the run counts as not finished", path, error)
        return None
    return metrics if isinstance(metrics, dict) else None


def _finished(config: TrainConfig, out: Path, taken: int | None) -> bool:
    """Whether the run in `out` is finished as `config` asks: model and metrics written, its steps reached (and
    no state past them)."""
    metrics = _read_metrics(out)
    return (
        metrics is not None
        and (out / MODEL).is_file()
        and metrics.get("steps") == config.steps
        and len(metrics.get("loss") or ()) == config.steps
        and (taken is None or taken == config.steps)
    )


def _check_settings(
    config: TrainConfig, out: Path, saved: dict[str, Any] | None, state: Path | None, taken: int | None
) -> tuple[dict[str, Any], ...]:
    """A continued run uses the settings the run was trained with, except those it says it changes (change=...,
    from CHANGEABLE): checked against run.json and against the saved state itself (its recorded settings, its
    optimizer's hyperparameters, its accumulation), which is what a resumed run continues from whatever run.json
    says. Returns run.json's record of changes with this resume's added."""
    given = config.settings()
    changing = config.changes()
    recorded: dict[str, Any] = {}
    chosen: Path | None = None
    shared: dict[str, Any] = {}
    if state is not None:
        chosen, shared, _ = read_state_directory(state, 0)
        recorded = (shared.get("extra") or {}).get("settings", {}).get("value")
        recorded = recorded if isinstance(recorded, dict) else {}
    # run.json, then the state's own record: what the run was trained with up to now
    sources = [(saved or {}, ""), (recorded, f" (its state {str(chosen)!r} says so)")]
    for key in RESUME_MUST_MATCH:
        for values, where in sources:
            if key in values and values[key] != given[key]:
                raise ValueError(
                    f"{key}: the run in {str(out)!r} was trained with {values[key]!r}{where}, got {given[key]!r}; "
                    "resume with the same value"
                )
    known = {**(saved or {}), **recorded}
    changes = []
    for key in CHANGEABLE:
        if key not in known or known[key] == given[key]:
            continue
        if key == "steps" and given["schedule"] == "constant" and known.get("schedule", "constant") == "constant":
            continue  # more (or the same) steps at a constant rate: the run continues as it would have
        if key not in changing:
            where = next(where for values, where in sources if key in values)
            raise ValueError(
                f"{key}: the run in {str(out)!r} was trained with {known[key]!r}{where}, got {given[key]!r}; to "
                f"change it from step {taken or 0} on, pass change={key} (recorded in {RUN_SETTINGS}), or resume with "
                "the same value"
            )
        changes.append({"step": taken or 0, "setting": key, "from": known[key], "to": given[key]})
    if state is None:
        return tuple((saved or {}).get("changes") or ()) + tuple(changes)
    optimizers = shared.get("optimizers") or []
    for group in optimizers[0].get("param_groups", []) if optimizers and isinstance(optimizers[0], dict) else []:
        # the peak rate of a scheduled run is the group's initial_lr; a run without a schedule kept it as lr
        for key, value in (("lr", group.get("initial_lr", group.get("lr"))), ("momentum", group.get("momentum"))):
            if value is not None and value != given[key] and key not in changing:
                raise ValueError(
                    f"{key}: the optimizer saved in {str(chosen)!r} has {key} {value!r}, got {given[key]!r}; "
                    + (
                        f"to change it from step {taken or 0} on, pass change={key}, or resume with the same value"
                        if key in CHANGEABLE
                        else "resume with the same value (a resumed optimizer continues with its saved one)"
                    )
                )
    if shared.get("accumulate") not in (None, config.accumulate):
        raise ValueError(
            f"accumulate: the run in {str(out)!r} was trained with {shared['accumulate']!r} (its state "
            f"{str(chosen)!r} says so), got {config.accumulate!r}; resume with the same value"
        )
    if saved is None and not recorded:
        unchecked = ["seed", "batch_size"] + (["lr", "momentum"] if not optimizers else [])
        log.warning(
            "%s: no %s and a state without recorded settings; %s cannot be checked (the model's shapes and the "
            "data's size are checked as the state loads)",
            out,
            RUN_SETTINGS,
            ", ".join(unchecked),
        )
    return tuple((saved or {}).get("changes") or ()) + tuple(changes)


def _check_out(config: TrainConfig) -> Plan:
    """What the run does with its folder; refuses a folder holding a run that is neither resumed nor
    overwritten. A restarted worker group checks the same as the first attempt: the only difference a restart
    makes is that the run its own job created (run.json names the job) is continued, not refused."""
    out = Path(config.out)
    job = job_id()
    # metrics.csv and TensorBoard's files alone are what a run logged before it failed: a new run replaces them
    holds = [name for name in (*RUN_FILES, STATE_FOLDER) if name != METRICS_CSV and (out / name).exists()]
    states = saved_states(out)
    taken = step_of(states[-1]) if states else None
    saved = _read_settings(out) if config.resume else None
    ours = False
    if restart_count() > 0:  # a run.json that does not name this job (or no run.json) is another run's
        with contextlib.suppress(ValueError):
            saved = _read_settings(out)
            ours = saved is not None and saved.get("job") == job
    if (out / STATE_FOLDER).is_dir() and (config.checkpoint_every or (config.overwrite and not ours)):
        _check_writable(out / STATE_FOLDER, out, "the training state")
    if config.resume or ours:
        changes = _check_settings(config, out, saved, out / STATE_FOLDER if states else None, taken)
        if _finished(config, out, taken):
            return Plan(job, finished=True)
        if taken is None:
            if ours:
                return Plan(job)  # this job saved no state yet: it starts again
            raise ValueError(
                f"resume: no saved state in {str(out / STATE_FOLDER)!r}; a run saves one with checkpoint_every=K"
            )
        if taken > config.steps:
            raise ValueError(
                f"steps: the run in {str(out)!r} has already taken {taken} steps; give {taken} to finish it or more "
                "to continue it"
            )
        return Plan(job, changes=changes, resume=True)
    if holds and not config.overwrite:
        raise ValueError(
            f"out: {str(out)!r} already holds a run ({', '.join(holds)}); resume it (resume=True), replace it "
            "(overwrite=True), or choose another folder"
        )
    return Plan(job, remove=bool(holds))


def check_config(config: TrainConfig) -> list[torch.device]:
    """Every setting checked without building or measuring anything: the values, the packages they need
    (TensorBoard), the devices, the batch's split over them and the run folder's path; one line on the first bad
    value. The devices the run uses. strategy="auto" is checked as far as it can be before auto chooses."""
    for name in ("steps", "batch_size", "accumulate", "keep", "log_every"):
        check_int(getattr(config, name), name)
    for name in ("checkpoint_every", "eval_every"):
        if getattr(config, name) is not None:
            check_int(getattr(config, name), name)
    check_int(config.max_restarts, "max_restarts", minimum=0)
    if config.hang_timeout_seconds is not None:
        check_number(config.hang_timeout_seconds, "hang_timeout_seconds", positive=True)
    _check_optimization(config)
    check_seed(config.seed)
    if config.precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {config.precision!r}")
    check_output_folder(config.out, "out")
    if config.resume and config.overwrite:
        raise ValueError(
            "resume/overwrite: give one: resume=True continues the run in the folder, overwrite=True replaces it"
        )
    if config.strategy == "auto":
        devices = resolve_devices(config.accelerator, config.devices)
        check_batch_split(config.batch_size, len(devices))
        Precision(config.precision, devices[0].type)
        return devices
    traits = strategy_class(config.strategy).traits
    devices = resolve_devices(
        config.accelerator, traits.max_devices if config.devices == "auto" and traits.max_devices else config.devices
    )
    if traits.max_devices is not None and len(devices) > traits.max_devices:
        others = [name for name in available_strategies() if strategy_class(name).traits.max_devices is None]
        raise ValueError(
            f"devices: strategy '{config.strategy}' runs on {traits.max_devices} device(s), got {len(devices)}; "
            f"to train on {len(devices)} devices pass a strategy for several ({', '.join(others)}; "
            f"docs/strategies.md says which), or devices={traits.max_devices}"
        )
    Precision(config.precision, devices[0].type)  # what the devices cannot do, refused here, not in each process
    if strategy_class(config.strategy).needs_launcher():
        check_process_count(len(devices), argument="devices", force=config.force)
    check_batch_split(config.batch_size, _processes(config, devices))
    return devices


def _processes(config: TrainConfig, devices: Sequence[torch.device]) -> int:
    """Among how many the global batch is split: the launched processes, or the devices of this one."""
    per_device = strategy_class(config.strategy).traits.processes == PER_DEVICE
    return int(os.environ["WORLD_SIZE"]) if per_device and launched() else len(devices)


def _check_folder(config: TrainConfig) -> None:
    """The run folder as prepare checks it (its lock, a run it already holds), before auto measures anything;
    the lock is released again (prepare takes it for the run)."""
    lock = FolderLock(Path(config.out)).take() if _lock_holder(config) else None
    try:
        _check_out(config)
    finally:
        if lock is not None:
            lock.release()


def prepare(config: TrainConfig) -> Prepared:
    """Check every setting, take the run folder's lock, decide what to do with the folder, build the model and
    load the data; raise one line on the first bad value (releasing the lock). The caller releases
    `Prepared.lock` when the run ends."""
    devices = check_config(config)
    out = Path(config.out)
    # the folder is decided by one process (under a launcher rank 0, which tells the others), under its lock
    decides = not launched() or os.environ.get("RANK") == "0"
    lock = FolderLock(out).take() if _lock_holder(config) else None
    try:
        plan = _check_out(config) if decides else None
        if plan is not None and plan.finished:
            return Prepared(nn.Identity(), (torch.empty(0),) * 4, plan, lock)

        source = model_source(config.example, config.model, config.data)
        torch.manual_seed(config.seed)  # same initial weights in every process and for every strategy
        model = source.build_model()
        data = source.load_classification_data(config.seed)
        check_model_fits(model, data[0], data[1], "model" if config.model else "data")
        rows = len(data[0])
        if config.batch_size > rows:
            raise ValueError(
                f"batch_size: {config.batch_size} is larger than the {rows} training rows; use at most {rows}"
            )
        check_last_batch(config.batch_size, rows, _processes(config, devices))
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Prepared(model, data, plan, lock)


def _check_optimization(config: TrainConfig) -> None:
    """The optimizer, schedule, clipping, evaluation and metrics settings, each refused in one line."""
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, got {config.optimizer!r}")
    if config.schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {config.schedule!r}")
    check_number(config.lr, "lr", positive=True)
    check_number(config.momentum, "momentum")
    check_number(config.weight_decay, "weight_decay")
    if config.momentum and config.optimizer != "sgd":
        raise ValueError(
            f"momentum: applies to optimizer=sgd, got momentum={config.momentum:g} with optimizer={config.optimizer} "
            "(adam and adamw have their own betas); leave momentum at 0"
        )
    check_int(config.lr_warmup_steps, "lr_warmup_steps", minimum=0)
    if config.lr_warmup_steps > config.steps:
        raise ValueError(
            f"lr_warmup_steps: {config.lr_warmup_steps} is more than the run's {config.steps} steps; use at most "
            f"{config.steps}"
        )
    if config.clip_grad_norm is not None:
        check_number(config.clip_grad_norm, "clip_grad_norm", positive=True)
    if config.batch_size_per_device is not None:
        check_int(config.batch_size_per_device, "batch_size_per_device")
    if config.keep_best is not None:
        if config.keep_best not in BEST_BY:
            raise ValueError(f"keep_best: expected one of {', '.join(BEST_BY)}, got {config.keep_best!r}")
        if config.eval_every is None:
            raise ValueError(
                f"keep_best: the best model by {config.keep_best} needs evaluations; add eval_every=K (steps)"
            )
    changing = config.changes()
    unknown = [name for name in changing if name not in CHANGEABLE]
    if unknown:
        raise ValueError(
            f"change: {', '.join(unknown)} cannot change mid-run; a resumed run may change {', '.join(CHANGEABLE)}"
        )
    if changing and not config.resume:
        raise ValueError(f"change: goes with resume=True (a new run has nothing to change), got change={changing[0]}")
    if config.tensorboard:
        tensorboard_writer_class()  # installed, or one line saying how to get it


def resolve_batch(config: TrainConfig) -> TrainConfig:
    """batch_size_per_device given: the config with its global batch (that many times the devices, or the
    launched processes), which is what the run records and checks."""
    if config.batch_size_per_device is None:
        return config
    check_int(config.batch_size_per_device, "batch_size_per_device")
    if launched():
        count = int(os.environ["WORLD_SIZE"])
    else:
        traits = strategy_class(config.strategy).traits
        count = len(resolve_devices(config.accelerator, config.devices))
        if traits.max_devices is not None and config.devices == "auto":
            count = min(count, traits.max_devices)
    return dataclasses.replace(config, batch_size=config.batch_size_per_device * count, batch_size_per_device=None)


def resolve_auto(config: TrainConfig) -> TrainConfig:
    """strategy="auto": the config with the strategy (and device count) dpkit.choose_strategy picks for this model,
    batch and these devices, said in one line. The processes it starts are told the choice (AUTO_VARIABLE); under
    another launcher, which has started a process per device, the choice is ddp."""
    if config.strategy != "auto":
        return config
    if launched():  # the processes a run started are told its choice; another launcher's run ddp
        return dataclasses.replace(config, strategy=os.environ.get(AUTO_VARIABLE) or "ddp")
    devices = check_config(config)  # everything cheap before auto measures anything
    chosen = _chosen_when_the_run_began(config, devices) if config.resume else None
    if chosen is not None:
        # a choice measured on the machine's timing is the run's: measured again it could differ, and another
        # strategy sums in another order, so a resumed run continues with the one it began with
        print(f"dpkit train: auto: {chosen.strategy}, as chosen when the run began (recorded in run.json)", flush=True)
        return chosen
    _check_folder(config)
    source = model_source(config.example, config.model, config.data)
    torch.manual_seed(config.seed)
    model = source.build_model()
    x_train = source.load_classification_data(config.seed)[0]
    choice = choose_strategy(
        model,
        x_train[: min(config.batch_size, len(x_train))],
        config.batch_size,
        devices,
        precision=config.precision,
        optimizer=config.optimizer,
        can_launch=config.relaunch is not None,
    )
    print(f"dpkit train: {choice.reason}", flush=True)
    devices_given = devices[: choice.devices] if choice.devices < len(devices) else config.devices
    if isinstance(devices_given, list):
        devices_given = [str(device) for device in devices_given]
    return dataclasses.replace(config, strategy=choice.strategy, devices=devices_given)


def _chosen_when_the_run_began(config: TrainConfig, devices: list[torch.device]) -> TrainConfig | None:
    """The config with the strategy (and devices) run.json says the run in config.out ran with; None when it says
    nothing usable (then auto measures, and the resume checks report a damaged run.json)."""
    try:
        recorded = _read_settings(Path(config.out)) or {}
    except ValueError:
        return None
    strategy = recorded.get("strategy")
    if strategy not in available_strategies():
        return None
    used = recorded.get("processes") if strategy_class(strategy).traits.processes == PER_DEVICE else None
    if not isinstance(used, int):
        used = len(recorded.get("devices") or ())
    if 0 < used < len(devices):
        return dataclasses.replace(config, strategy=strategy, devices=[str(device) for device in devices[:used]])
    return dataclasses.replace(config, strategy=strategy)


def _remove_run(out: Path) -> None:
    """overwrite=True: only what a run writes goes, nothing else the folder holds."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for folder in (STATE_FOLDER, TENSORBOARD_FOLDER):
        shutil.rmtree(out / folder, ignore_errors=True)


def _say_finished(config: TrainConfig) -> dict[str, Any] | None:
    out = Path(config.out)
    print(
        f"dpkit train: the run in {out} is already finished ({config.steps} steps; {out / MODEL} and "
        f"{out / METRICS} are written); nothing to do",
        flush=True,
    )
    return _read_metrics(out)


def _write_json(path: Path, value: Any) -> None:
    """JSON written whole or not at all (a temporary file renamed over `path`); allow_nan=False: a nan that
    slipped through is an error here, never invalid JSON on disk."""
    text = json.dumps(value, indent=2, allow_nan=False) + "\n"
    atomic_write(path, lambda handle: handle.write(text.encode()))


def _best_files(out: Path) -> dict[str, torch.Tensor]:
    """best.pt and best.json's bytes (those that exist), for the saved state."""
    return {
        name: torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for name in (BEST_MODEL, BEST)
        if (out / name).is_file() and (data := (out / name).read_bytes())
    }


def _restore_best_files(out: Path, saved: dict[str, torch.Tensor] | None) -> None:
    """best.pt and best.json back to what they were when the state was saved: each written whole (or removed
    when the state had none), best.json out first and in last, so a best.json always describes its best.pt."""
    saved_bytes = {name: bytes(data.numpy()) for name, data in (saved or {}).items()}
    on_disk = {name: (out / name).read_bytes() for name in (BEST_MODEL, BEST) if (out / name).is_file()}
    if on_disk == saved_bytes:
        return  # nothing was written after the state: the common case
    (out / BEST).unlink(missing_ok=True)
    for name in (BEST_MODEL, BEST):
        if name in saved_bytes:
            atomic_write(out / name, lambda handle, data=saved_bytes[name]: handle.write(data))
        else:
            (out / name).unlink(missing_ok=True)


# --- one process per device: start them, and report for them ------------------------------------------


@contextlib.contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    """os.environ with `values` set (None: unset) for the processes started inside, restored afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _only_refusals(exit_codes: dict[int, int]) -> bool:
    """Every failed worker refused bad input (exit 2, and said why) or was stopped because another did."""
    stopped = {-int(signal.SIGTERM), 128 + int(signal.SIGTERM)}
    codes = set(exit_codes.values())
    return BAD_INPUT_EXIT_CODE in codes and codes <= {BAD_INPUT_EXIT_CODE, *stopped}


def run_processes(config: TrainConfig, prepared: Prepared | None = None) -> dict[str, Any]:
    """Run this same training once per device under the launcher (config.relaunch says how), and report.

    The processes check everything again and rank 0 of them acts on the folder (removes an overwritten run
    once all of them have passed their checks); this process holds the folder's lock for the whole job, its
    restarts included."""
    if config.relaunch is None:
        raise RuntimeError(
            f"strategy: '{config.strategy}' runs one process per device "
            "and this process was not started by a launcher; "
            "start your script with `dpkit launch --nproc-per-node N script.py`, use `dpkit train`, or give the config "
            "a relaunch= that runs this training again"
        )
    n_devices = len(resolve_devices(config.accelerator, config.devices))
    out = Path(config.out)
    before = _newest_state(out)
    job = prepared.plan.job if prepared is not None and prepared.plan is not None else f"process {uuid.uuid4().hex}"
    held = prepared is not None and prepared.lock is not None
    workers = {
        JOB_VARIABLE: job,
        LOCKED_VARIABLE: str(out.absolute()) if held else None,
        AUTO_VARIABLE: config.strategy,  # what strategy="auto" chose, for processes whose command line says auto
    }
    try:
        with _environment(workers):
            relaunch(
                config.relaunch,
                n_devices,
                max_restarts=config.max_restarts,
                hang_timeout_seconds=config.hang_timeout_seconds,
                force=config.force,
            )
    except KeyboardInterrupt:
        raise StoppedBySignal(_stopped_message_after(config, signal.SIGINT, before), signal.SIGINT) from None
    except StoppedBySignal as stopped:
        raise StoppedBySignal(_stopped_message_after(config, stopped.signum, before), stopped.signum) from None
    except LaunchError as error:
        if DIVERGED_EXIT_CODE in error.exit_codes.values():
            raise TrainingDiverged("") from None  # rank 0 said why in one line
        if _only_refusals(error.exit_codes):
            bad_input = ValueError("")  # the worker that refused said why in one line
            raise bad_input from None
        raise
    metrics = json.loads((out / METRICS).read_text())
    print(
        f"dpkit train: {config.strategy} over {n_devices} processes done; final loss {metrics['loss'][-1]:.4f}, "
        f"{metrics['samples_per_second']:.0f} samples/s, test accuracy {metrics['test_accuracy']:.4f}"
    )
    return metrics


def _newest_state(out: Path) -> Path | None:
    states = saved_states(out)
    return states[-1] if states else None


def _stopped_message_after(config: TrainConfig, signum: int, before: Path | None) -> str:
    """The stop line of the process that started the workers: a state newer than `before` is theirs."""
    newest = _newest_state(Path(config.out))
    saved = newest if newest is not None and newest != before else None
    return _stopped_message(config, signum, None, saved, newest)


def _stopped_message(
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


# --- stopping at a step boundary --------------------------------------------------------------------


class StopRequest:
    """SIGINT/SIGTERM/SIGHUP ask the run to stop at the next boundary (after the current step, or in the final
    evaluation) and save, with checkpoint_every; a second Ctrl-C stops at once."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def _handle(self, signum: int, frame: Any) -> None:
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


# --- training -----------------------------------------------------------------------------------------


class LossLog:
    """The global batch's mean loss of every step, reduced across processes a few steps at a time."""

    def __init__(self, engine: Engine, losses: Sequence[float] = (), rows: Sequence[int] = ()):
        self.engine = engine
        self.losses, self.rows = list(losses), list(rows)  # per step done (reduced): mean loss, global rows
        self._pending_sums: list[torch.Tensor] = []  # this process's loss sums and rows since the last reduce
        self._pending_rows: list[int] = []

    def add_step(self, loss_sum: torch.Tensor, rows: int) -> None:
        self._pending_sums.append(loss_sum)
        self._pending_rows.append(rows)

    def reduce(self) -> None:
        if self._pending_sums:
            sums = self.engine.reduce(torch.stack(self._pending_sums).double(), "sum")
            rows = self.engine.reduce(torch.tensor(self._pending_rows, dtype=torch.float64), "sum")
            self.losses.extend((sums / rows).tolist())
            self.rows.extend(int(r) for r in rows.tolist())
            self._pending_sums.clear()
            self._pending_rows.clear()


def train(config: TrainConfig, prepared: Prepared | None = None) -> dict[str, Any] | None:
    """Train in this process (one of the strategy's processes under a launcher); the metrics on rank 0."""
    config = resolve_batch(config)
    config = resolve_auto(config)
    threads = torch.get_num_threads()  # the run sets its own (see _train); a caller's process gets its own back
    try:
        if prepared is not None:
            return _train(config, prepared)
        prepared = prepare(config)
        try:
            return _train(config, prepared)
        finally:
            prepared.release()
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _train(config: TrainConfig, prepared: Prepared) -> dict[str, Any] | None:
    out = Path(config.out)
    engine = Engine(
        strategy=config.strategy,
        accelerator=config.accelerator,
        devices=config.devices,
        precision=config.precision,
        accumulate=config.accumulate,
        progress=config.progress,
    )
    if engine.device.type == "cpu" and strategy_class(config.strategy).traits.processes != PER_DEVICE:
        # the intra-op threads decide how large sums are split, so the run's count comes from the machine, never
        # from what the process ran before (a process per device has its share already); a resume takes the
        # state's count (engine.load_state)
        torch.set_num_threads(available_cores())
    # rank 0 decided what to do with the folder; the others learn it here
    plan: Plan = engine.gather_object(prepared.plan)[0]
    if plan.finished:
        engine.close()
        return _say_finished(config) if engine.is_global_zero else None

    model, (x_train, y_train, x_test, y_test) = prepared.model, prepared.data
    base_optimizer = build_optimizer(
        config.optimizer, model.parameters(), config.lr, config.momentum, config.weight_decay
    )
    model, optimizer = engine.setup(model, base_optimizer)
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    train_data = TensorDataset(x_train, y_train)
    # the batch order comes from its own seeded generator: the same global batches for every strategy
    order = RandomSampler(train_data, generator=torch.Generator().manual_seed(config.seed))
    loader = engine.setup_dataloader(DataLoader(train_data, batch_size=config.batch_size, sampler=order))
    best = Best(config.keep_best, BEST_BY[config.keep_best]) if config.keep_best else None

    def write_settings() -> None:
        # with the first saved state or the final model (a run that wrote nothing else leaves nothing behind),
        # and again with every later one: run.json says what the run is now, its changes included
        if engine.is_global_zero:
            where = {
                "strategy": config.strategy,
                "devices": [str(d) for d in engine.devices],
                "processes": engine.world_size,
            }
            _write_json(
                out / RUN_SETTINGS, {**config.settings(), **where, "job": plan.job, "changes": list(plan.changes)}
            )

    losses = LossLog(engine)
    step_seconds: list[float] = []
    seconds_before = 0.0
    if plan.resume:
        extras = engine.load_state(out / STATE_FOLDER)
        losses = LossLog(engine, extras["losses"], extras["rows"])
        step_seconds, seconds_before = list(extras["step_seconds"]), float(extras["seconds"])
        if best is not None and config.keep_best is not None:  # (best is kept when keep_best is given)
            best = Best(config.keep_best, BEST_BY[config.keep_best], extras.get("best"))
        if engine.step > config.steps:
            raise ValueError(
                f"steps: the run in {str(out)!r} has already taken {engine.step} steps; give {engine.step} to "
                "finish it or more to continue it"
            )
        if best is not None and engine.is_global_zero and "best_files" in extras:
            # what a later, discarded part of the run wrote there is not this run's best
            _restore_best_files(out, extras["best_files"])
    if plan.remove:
        # every process is here, so every process passed every check (its own, the Engine's, the setup's): only
        # now does the old run go
        engine.barrier()
        if engine.is_global_zero:
            _remove_run(out)
        engine.barrier()

    micro_losses, micro_rows = [], 0
    steps_done = len(losses.losses)
    # the rate of the next step comes from the schedule at this step (a resumed run's changes included)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's "scheduler before optimizer" guess does not apply
        scheduler = schedule_at(
            base_optimizer, config.lr, config.schedule, config.steps, config.lr_warmup_steps, steps_done
        )
    metrics_log = (
        MetricsLog(
            out,
            tensorboard=config.tensorboard,
            resume_step=steps_done if plan.resume else 0,
            evaluates_again=steps_done >= config.steps,  # a run stopped at its end evaluates its last step again
        )
        if engine.is_global_zero
        else None
    )
    logged = steps_done  # steps whose row is in metrics.csv
    step_rates: dict[int, tuple[float, float | None]] = {}  # step -> (lr, grad norm) until its row is written
    saved_path: Path | None = None
    stop = StopRequest()

    def log_rows() -> None:
        nonlocal logged
        losses.reduce()
        if metrics_log is not None:
            for step in range(logged + 1, len(losses.losses) + 1):
                lr, norm = step_rates.pop(step, (None, None))
                metrics_log.add(step, loss=losses.losses[step - 1], lr=lr, grad_norm=norm)
        step_rates.clear()
        logged = len(losses.losses)

    def save_state(seconds: float) -> Path:
        log_rows()
        write_settings()
        return engine.save_state(
            out / STATE_FOLDER,
            keep=config.keep,
            losses=list(losses.losses),
            rows=list(losses.rows),
            step_seconds=list(step_seconds),
            seconds=seconds,
            settings={**config.settings(), "job": plan.job},
            best=best.record() if best is not None else None,
            # best.pt and best.json as they are at this step: a resume from here rolls them back to them
            best_files=_best_files(out) if best is not None and engine.is_global_zero else None,
        )

    def agreed(*flags: bool) -> list[bool]:
        """Whether any process raised each flag: every process stops at the same point."""
        tensor = torch.tensor([float(flag) for flag in flags])
        if engine.world_size > 1:
            tensor = engine.reduce(tensor, "sum")
        return [bool(value > 0) for value in tensor]

    def stopped(during: str = "") -> StoppedBySignal:
        signum = stop.signum if stop.signum is not None else signal.SIGTERM  # a peer was stopped
        quiet = not engine.is_global_zero or relaunched()
        newest = saved_path or _newest_state(out)
        message = _stopped_message(config, signum, steps_done, saved_path, newest, during)
        return StoppedBySignal("" if quiet else message, signum)

    def evaluation(during: str) -> Scores:
        scores = evaluate(engine, model, x_test, y_test, lambda: agreed(stop.signum is not None)[0])
        if scores is None:
            raise stopped(during)
        if not (math.isfinite(scores.loss) and math.isfinite(scores.accuracy)):
            # divergence as a nan training loss is: every process has the same figures, so every one stops here,
            # before any file (metrics.csv's row, best.pt, best.json) is written from them
            lr = base_optimizer.param_groups[0]["lr"]
            raise TrainingDiverged(
                f"lr: the evaluation loss became {scores.loss:g} (accuracy {scores.accuracy:g}) at step "
                f"{steps_done} with lr={lr:g}; training stopped and wrote nothing from it; try a smaller lr"
                + (" or clip_grad_norm=1" if config.clip_grad_norm is None else "")
                if engine.is_global_zero
                else ""  # rank 0 says it once
            )
        if metrics_log is not None:
            metrics_log.add(steps_done, eval_loss=scores.loss, eval_accuracy=scores.accuracy)
        if best is not None and best.improves(scores):  # the same figures everywhere: every process agrees
            best.take(steps_done, scores)
            engine.save(model, out / BEST_MODEL)
            if engine.is_global_zero:
                _write_json(out / BEST, {**best.record(), "loss": scores.loss, "accuracy": scores.accuracy})
        return scores

    try:
        with stop.installed():
            # said once the stop request is listening: a signal after this line stops at a boundary
            engine.print(
                f"dpkit train: {config.model or config.example} with strategy {config.strategy} on "
                f"{engine.world_size} process(es), devices {', '.join(map(str, engine.devices))}, global batch "
                f"{config.batch_size}, {config.optimizer} lr {config.lr:g} ({config.schedule}"
                + (f", {config.lr_warmup_steps} warm-up steps" if config.lr_warmup_steps else "")
                + ")"
                + (f", clip {config.clip_grad_norm:g}" if config.clip_grad_norm else "")
                + f", precision {config.precision}"
                + (f", resuming at step {steps_done}" if plan.resume else "")
                + "".join(
                    f"; {c['setting']} {c['from']!r} -> {c['to']!r}"
                    for c in plan.changes
                    if plan.resume and c["step"] == steps_done
                )
                + (" (all steps taken: evaluating and writing the final files)" if steps_done >= config.steps else ""),
                flush=True,
            )
            bar = engine.progress(total=config.steps, initial=steps_done, desc="training", unit="step")
            started = time.perf_counter()
            step_started = started
            try:
                while steps_done < config.steps:
                    for x, y in loader:
                        optimizer.zero_grad()
                        loss = criterion(model(x), y)
                        engine.backward(loss)
                        micro_losses.append(loss.detach().float() * len(y))
                        micro_rows += len(y)
                        boundary = len(micro_losses) == config.accumulate
                        norm = None
                        if boundary and config.clip_grad_norm is not None:
                            norm = float(engine.clip_gradients(optimizer, config.clip_grad_norm))
                        lr = base_optimizer.param_groups[0]["lr"]
                        optimizer.step()
                        if not boundary:
                            continue
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore", UserWarning)  # a strategy may step copies of the optimizer
                            scheduler.step()
                        step_loss = torch.stack(micro_losses).sum().cpu()  # one optimizer step done
                        losses.add_step(step_loss, micro_rows)
                        micro_losses, micro_rows = [], 0
                        steps_done += 1
                        step_rates[steps_done] = (lr, norm)
                        now = time.perf_counter()
                        step_seconds.append(now - step_started)
                        step_started = now
                        bar.update()
                        # every process stops at the same step: a signal or a non-finite loss on any one counts
                        stopping, diverged = agreed(stop.signum is not None, not torch.isfinite(step_loss))
                        if diverged:
                            raise TrainingDiverged(
                                f"lr: the loss became {float(step_loss):g} at step {steps_done} with "
                                f"lr={lr:g}; training stopped and wrote nothing from it; try a smaller lr"
                                + (" or clip_grad_norm=1" if config.clip_grad_norm is None else "")
                                if engine.is_global_zero
                                else ""  # rank 0 says it once
                            )
                        if steps_done % config.log_every == 0:
                            log_rows()
                        if config.eval_every and steps_done % config.eval_every == 0 and steps_done < config.steps:
                            log_rows()
                            evaluation(f"in the evaluation at step {steps_done}")
                        seconds = seconds_before + time.perf_counter() - started
                        if config.checkpoint_every and (
                            steps_done % config.checkpoint_every == 0 or stopping or steps_done == config.steps
                        ):
                            saved_path = save_state(seconds)
                        if stopping:
                            raise stopped()
                        if steps_done == config.steps:
                            break
            finally:
                bar.close()
            seconds = seconds_before + time.perf_counter() - started
            log_rows()
            samples_per_second = sum(losses.rows) / seconds if seconds > 0 else 0.0
            scores = evaluation("in the final evaluation")

            # the final files: a stop that arrives now lets them be written (each whole or not at all)
            write_settings()
            engine.save(model, out / MODEL)
            metrics = None
            if engine.is_global_zero:
                metrics = {
                    "strategy": config.strategy,
                    "devices": [str(d) for d in engine.devices],
                    "world_size": engine.world_size,
                    "precision": config.precision,
                    "accumulate": config.accumulate,
                    "steps": config.steps,
                    "batch_size": config.batch_size,
                    "seed": config.seed,
                    "optimizer": config.optimizer,
                    "lr": config.lr,
                    "schedule": config.schedule,
                    "loss": losses.losses,
                    "samples_per_second": samples_per_second,
                    "seconds": seconds,
                    "median_step_seconds": sorted(step_seconds)[len(step_seconds) // 2] if step_seconds else 0.0,
                    "test_loss": scores.loss,
                    "test_accuracy": scores.accuracy,
                    "test_samples": scores.samples,
                    "best": best.record() if best is not None else None,
                    "resumed": plan.resume,
                    "changes": list(plan.changes),
                }
                _write_json(out / METRICS, metrics)
                print(
                    f"final loss {losses.losses[-1]:.4f}, {samples_per_second:.0f} samples/s, test accuracy "
                    f"{metrics['test_accuracy']:.4f}"
                    + (f" (best {best.metric} {best.value:.4f} at step {best.step})" if best is not None else "")
                    + f"; wrote {out / MODEL}, {out / METRICS} and {out / METRICS_CSV}",
                    file=sys.stdout,
                )
    except (StoppedBySignal, TrainingDiverged, KeyboardInterrupt):
        raise
    except Exception:
        if stop.signum is not None:  # a peer stopped first and its collective broke: the stop, not the error, is news
            raise StoppedBySignal("", stop.signum) from None
        raise
    finally:
        if metrics_log is not None:
            metrics_log.close()
    engine.close()
    return metrics
