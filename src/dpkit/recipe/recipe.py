"""The training recipe behind `dpkit train`, as library code: train an example (or your model and data) with
any strategy, then write model.pt, metrics.json and run.json into a folder.

    from dpkit.recipe.recipe import TrainConfig, run
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

The rooms, top to bottom: this module (where the run runs: the config's batch and `auto` resolved, and the
processes started where the strategy needs one per device), run_config (the config and its checks),
run_checks (the folder's plan and what is built once), run_folder (the folder's files and lock), run (the
`Run`: the loop), run_metrics (what it records), run_stop (stopping at a boundary).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dpkit.launch import LaunchError, StoppedBySignal, launched, relaunch
from dpkit.plan.auto import choose_strategy
from dpkit.recipe.checks import Prepared, check_folder, check_streams_strategy, prepare
from dpkit.recipe.config import (
    BAD_INPUT_EXIT_CODE,
    DIVERGED_EXIT_CODE,
    TrainConfig,
    TrainingDiverged,
    check_config,
    placement_of,
    resolve_batch,
)
from dpkit.recipe.folder import (
    JOB_VARIABLE,
    LOCKED_VARIABLE,
    METRICS,
    newest_state,
    read_settings,
    say_finished,
)
from dpkit.recipe.run import Run
from dpkit.recipe.sources import model_source
from dpkit.recipe.stop import stopped_message_after
from dpkit.recipe.streams import is_stream_factory
from dpkit.strategies import PER_DEVICE, available_strategies, strategy_class

# the strategy strategy="auto" chose, for the processes the run starts
AUTO_VARIABLE = "DPKIT_TRAIN_AUTO"


def run(config: TrainConfig) -> dict[str, Any] | None:
    """Check, then train (starting one process per device first where the strategy needs it). Returns the
    metrics written (None on the ranks other than 0); for a finished run given resume=True, its metrics."""
    config = resolve(config)
    prepared = prepare(config)
    try:
        if prepared.plan is not None and prepared.plan.finished and not launched():
            return say_finished(Path(config.out), config.steps)
        if strategy_class(config.strategy).needs_launcher():
            return run_processes(config, prepared)
        return train(config, prepared)
    finally:
        prepared.release()


def train(config: TrainConfig, prepared: Prepared | None = None) -> dict[str, Any] | None:
    """Train in this process (one of the strategy's processes under a launcher); the metrics on rank 0."""
    config = resolve(config)
    threads = torch.get_num_threads()  # the run sets its own (see Run); a caller's process gets its own back
    try:
        if prepared is not None:
            return Run(config, prepared).execute()
        prepared = prepare(config)
        try:
            return Run(config, prepared).execute()
        finally:
            prepared.release()
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


# --- where the run runs ---------------------------------------------------------------------------------


def resolve(config: TrainConfig) -> TrainConfig:
    """The config with where it runs decided, in one place: its global batch (from batch_size_per_device and
    the devices or processes), then strategy="auto"'s choice (strategy and devices). The Placement of the
    decided config (run_config.placement_of) is what every later step reads."""
    return resolve_auto(resolve_batch(config))


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
    check_folder(config)
    source = model_source(config.example, config.model, config.data)
    if config.data is not None and is_stream_factory(source.loader):
        check_streams_strategy(config)  # (auto measures on a batch of a loader's tensors: not a stream's)
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
        recorded = read_settings(Path(config.out)) or {}
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
    n_devices = len(placement_of(config).devices)
    out = Path(config.out)
    before = newest_state(out)
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
        raise StoppedBySignal(stopped_message_after(config, signal.SIGINT, before), signal.SIGINT) from None
    except StoppedBySignal as stopped:
        raise StoppedBySignal(stopped_message_after(config, stopped.signum, before), stopped.signum) from None
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
