"""The checks a recipe run makes before any work, and what they decide: the settings a resumed run continues
with (against run.json and the saved state), what the run does with its folder (a `Plan`: start, resume,
overwrite once every process passed its checks, or nothing for a finished run), and the model and data built
once (`prepare`, under the folder's lock).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpkit.checkpoint.state import SharedState, read_state_directory
from dpkit.checkpoint.steps import step_of
from dpkit.launch import restart_count
from dpkit.launch.environment import process_place
from dpkit.recipe.config import (
    CHANGEABLE,
    RESUME_MUST_MATCH,
    TrainConfig,
    check_batch_against_data,
    check_config,
)
from dpkit.recipe.folder import (
    RUN_FILES,
    RUN_SETTINGS,
    STATE_FOLDER,
    FolderLock,
    check_writable,
    is_finished,
    job_id,
    lock_holder,
    read_settings,
    saved_states,
)
from dpkit.recipe.metrics_log import METRICS_CSV
from dpkit.recipe.sources import check_model_fits, model_source
from dpkit.recipe.streams import Streams, is_stream_factory
from dpkit.strategies import PER_DEVICE, available_strategies, strategy_class

Tensors4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
log = logging.getLogger("dpkit")


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
    data: Tensors4 | Streams  # the tensors of a loader(seed), or a per-process stream factory
    plan: Plan | None
    lock: FolderLock | None = None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def check_settings(
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
    shared: SharedState = {}
    if state is not None:
        chosen, shared, _ = read_state_directory(state, 0)
        value = (shared.get("extra") or {}).get("settings", {}).get("value")
        recorded = value if isinstance(value, dict) else {}
    # run.json, then the state's own record: what the run was trained with up to now
    sources = [(saved or {}, ""), (recorded, f" (its state {str(chosen)!r} says so)")]
    for key in RESUME_MUST_MATCH:
        for values, where in sources:
            if key in values and values[key] != given[key]:
                if key == "batch_size" and config.batch_size_per_device is not None:
                    raise ValueError(
                        f"{config.batch_given()}, and the run in {str(out)!r} was trained with a global batch of "
                        f"{values[key]!r}{where}; resume with the same global batch (batch_size={values[key]!r})"
                    )
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


def check_out(config: TrainConfig) -> Plan:
    """What the run does with its folder; refuses a folder holding a run that is neither resumed nor
    overwritten. A restarted worker group checks the same as the first attempt: the only difference a restart
    makes is that the run its own job created (run.json names the job) is continued, not refused."""
    out = Path(config.out)
    job = job_id()
    # metrics.csv and TensorBoard's files alone are what a run logged before it failed: a new run replaces them
    holds = [name for name in (*RUN_FILES, STATE_FOLDER) if name != METRICS_CSV and (out / name).exists()]
    states = saved_states(out)
    taken = step_of(states[-1]) if states else None
    resuming = config.resume or config.resume_from is not None
    if config.resume_from is not None:  # going back to that state (check_resume_from checked it is one of them)
        taken = step_of(Path(config.resume_from))
    saved = read_settings(out) if resuming else None
    ours = False
    if restart_count() > 0:  # a run.json that does not name this job (or no run.json) is another run's
        with contextlib.suppress(ValueError):
            saved = read_settings(out)
            ours = saved is not None and saved.get("job") == job
    if (out / STATE_FOLDER).is_dir() and (config.checkpoint_every or (config.overwrite and not ours)):
        check_writable(out / STATE_FOLDER, out, "the training state")
    if resuming or ours:
        source = Path(config.resume_from) if config.resume_from is not None else out / STATE_FOLDER
        changes = check_settings(config, out, saved, source if states else None, taken)
        if is_finished(out, config.steps, taken):
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


def check_folder(config: TrainConfig) -> None:
    """The run folder as prepare checks it (its lock, a run it already holds), before auto measures anything;
    the lock is released again (prepare takes it for the run)."""
    lock = FolderLock(Path(config.out)).take() if lock_holder(config.out) else None
    try:
        check_out(config)
    finally:
        if lock is not None:
            lock.release()


def check_streams_strategy(config: TrainConfig) -> None:
    """A per-process stream factory goes with a strategy that runs a process per device (each its own stream)."""
    if config.strategy == "auto" or strategy_class(config.strategy).traits.processes != PER_DEVICE:
        takers = [name for name in available_strategies() if strategy_class(name).traits.processes == PER_DEVICE]
        raise ValueError(
            f"data: {config.data!r} is a per-process stream factory (seed, rank, world_size), which goes with a "
            f"strategy that runs a process per device ({', '.join(takers)}); got strategy {config.strategy!r}"
        )


def prepare(config: TrainConfig) -> Prepared:
    """Check every setting, take the run folder's lock, decide what to do with the folder, build the model and
    load the data; raise one line on the first bad value (releasing the lock). The caller releases
    `Prepared.lock` when the run ends."""
    check_config(config)
    out = Path(config.out)
    # the folder is decided by one process (under a launcher rank 0, which tells the others), under its lock
    decides = process_place().is_first
    lock = FolderLock(out).take() if lock_holder(config.out) else None
    try:
        plan = check_out(config) if decides else None
        if plan is not None and plan.finished:
            return Prepared(nn.Identity(), (torch.empty(0),) * 4, plan, lock)

        source = model_source(config.example, config.model, config.data)
        torch.manual_seed(config.seed)  # same initial weights in every process and for every strategy
        model = source.build_model()
        data: Tensors4 | Streams
        if config.data is not None and is_stream_factory(source.loader):
            check_streams_strategy(config)
            data = Streams(source.loader, config.data)
            x, y = data.first_batch(config.seed)
            check_model_fits(model, x, y, "data")
        else:
            data = source.load_classification_data(config.seed)
            check_model_fits(model, data[0], data[1], "model" if config.model else "data")
            check_batch_against_data(config, len(data[0]))
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Prepared(model, data, plan, lock)
