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
without overwrite=True, checkpoint_every=K saves the resumable state every K steps and when SIGINT/SIGTERM
arrives, resume=True continues from it, a loss that becomes nan/inf stops the run (TrainingDiverged), and
under `dpkit launch --max-restarts` a restarted worker group resumes from the last state by itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from dpkit.checks import check_int, check_number, check_output_folder, check_seed
from dpkit.devices import check_process_count, resolve_devices
from dpkit.errors import DpkitError
from dpkit.launch import Command, LaunchError, StoppedBySignal, launched, relaunch, relaunched, restart_count
from dpkit.precision import PRECISIONS
from dpkit.strategies import PER_DEVICE, strategy_class
from dpkit.training.engine import Engine
from dpkit.training.sources import check_model_fits, model_source

log = logging.getLogger("dpkit")

# what a run leaves in its folder; any of them there means the folder holds a run
RUN_SETTINGS = "run.json"
RUN_FILES = ("model.pt", "metrics.json", RUN_SETTINGS)
STATE_FOLDER = "state"
# settings a resumed run must share with the run it continues (the saved optimizer brings its own lr back)
RESUME_MUST_MATCH = ("example", "model", "data", "seed", "batch_size", "accumulate", "lr", "momentum")
DIVERGED_EXIT_CODE = 3


class TrainingDiverged(DpkitError):
    """The loss became nan or inf; training stopped before writing anything from it."""

    exit_code = DIVERGED_EXIT_CODE


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
    seed: int = 0
    lr: float = 0.1
    momentum: float = 0.0
    precision: str = "32"
    accumulate: int = 1
    out: str = "runs/train"
    checkpoint_every: int | None = None
    keep: int = 2
    resume: bool = False
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
            "lr": self.lr,
            "momentum": self.momentum,
            "steps": self.steps,
        }


@dataclass
class Prepared:
    """What the checks produced, so nothing is built twice: the model, the data and how the run starts."""

    model: nn.Module
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    resume: bool


def run(config: TrainConfig) -> dict[str, Any] | None:
    """Check, then train (starting one process per device first where the strategy needs it). Returns the
    metrics written (None on the ranks other than 0)."""
    prepared = prepare(config)
    if strategy_class(config.strategy).needs_launcher():
        return run_processes(config)
    return train(config, prepared)


# --- checks, all before any work ----------------------------------------------------------------------


def saved_states(out: Path) -> list[Path]:
    """The saved states under OUT/state, oldest first."""
    return sorted(path for path in (out / STATE_FOLDER).glob("step-*") if path.is_dir())


def _check_out(config: TrainConfig) -> bool:
    """Whether the run resumes; refuses a folder holding a run that is neither resumed nor overwritten."""
    out = check_output_folder(config.out, "out")
    if config.resume and config.overwrite:
        raise ValueError(
            "resume/overwrite: give one: resume=True continues the run in the folder, overwrite=True replaces it"
        )
    holds = [name for name in (*RUN_FILES, STATE_FOLDER) if (out / name).exists()]
    if restart_count() > 0:
        return bool(saved_states(out))  # a restarted group picks up where the last state left off
    if config.resume:
        if not saved_states(out):
            raise ValueError(
                f"resume: no saved state in {str(out / STATE_FOLDER)!r}; a run saves one with checkpoint_every=K"
            )
        taken = max(int(path.name.split("-")[1]) for path in saved_states(out))
        if taken >= config.steps:
            raise ValueError(
                f"steps: the run in {str(out)!r} has already taken {taken} steps; give more than {taken} to continue it"
            )
        saved = json.loads((out / RUN_SETTINGS).read_text()) if (out / RUN_SETTINGS).exists() else {}
        for key in RESUME_MUST_MATCH:
            if key in saved and saved[key] != config.settings()[key]:
                raise ValueError(
                    f"{key}: the run in {str(out)!r} was trained with {saved[key]!r}, got "
                    f"{config.settings()[key]!r}; resume with the same value"
                )
        return True
    if holds and not config.overwrite:
        raise ValueError(
            f"out: {str(out)!r} already holds a run ({', '.join(holds)}); resume it (resume=True), replace it "
            "(overwrite=True), or choose another folder"
        )
    return False


def prepare(config: TrainConfig) -> Prepared:
    """Check every setting, build the model and load the data; raise one line on the first bad value."""
    for name in ("steps", "batch_size", "accumulate", "keep"):
        check_int(getattr(config, name), name)
    if config.checkpoint_every is not None:
        check_int(config.checkpoint_every, "checkpoint_every")
    check_int(config.max_restarts, "max_restarts", minimum=0)
    if config.hang_timeout_seconds is not None:
        check_number(config.hang_timeout_seconds, "hang_timeout_seconds", positive=True)
    check_number(config.lr, "lr")
    check_number(config.momentum, "momentum")
    check_seed(config.seed)
    if config.precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {config.precision!r}")
    traits = strategy_class(config.strategy).traits
    devices = resolve_devices(
        config.accelerator, traits.max_devices if config.devices == "auto" and traits.max_devices else config.devices
    )
    if traits.max_devices is not None and len(devices) > traits.max_devices:
        raise ValueError(
            f"devices: strategy '{config.strategy}' runs on {traits.max_devices} device(s), got {len(devices)}; "
            f"pass devices={traits.max_devices} or choose a strategy for several devices"
        )
    if strategy_class(config.strategy).needs_launcher():
        check_process_count(len(devices), argument="devices", force=config.force)
    resume = _check_out(config)

    source = model_source(config.example, config.model, config.data)
    torch.manual_seed(config.seed)  # same initial weights in every process and for every strategy
    model = source.build_model()
    data = source.load_classification_data(config.seed)
    check_model_fits(model, data[0], data[1], "model" if config.model else "data")
    rows = len(data[0])
    if config.batch_size > rows:
        raise ValueError(f"batch_size: {config.batch_size} is larger than the {rows} training rows; use at most {rows}")
    if traits.processes == PER_DEVICE:
        processes = int(os.environ["WORLD_SIZE"]) if launched() else len(devices)
        smallest = rows % config.batch_size or config.batch_size
        if smallest < processes:
            raise ValueError(
                f"batch_size: {config.batch_size} leaves a last batch of {smallest} row(s) for {processes} "
                f"processes; each needs at least one (choose a batch size whose last batch of {rows} rows "
                f"has >= {processes})"
            )
    return Prepared(model, data, resume)


def _remove_run(out: Path) -> None:
    """overwrite=True: only what a run writes goes, nothing else the folder holds."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / STATE_FOLDER, ignore_errors=True)


# --- one process per device: start them, and report for them ------------------------------------------


def run_processes(config: TrainConfig) -> dict[str, Any]:
    """Run this same training once per device under the launcher (config.relaunch says how), and report."""
    if config.relaunch is None:
        raise RuntimeError(
            f"strategy: '{config.strategy}' runs one process per device "
            "and this process was not started by a launcher; "
            "start your script with `dpkit launch --nproc-per-node N script.py`, use `dpkit train`, or give the config "
            "a relaunch= that runs this training again"
        )
    n_devices = len(resolve_devices(config.accelerator, config.devices))
    out = Path(config.out)
    if config.overwrite:
        _remove_run(out)
    try:
        relaunch(
            config.relaunch,
            n_devices,
            max_restarts=config.max_restarts,
            hang_timeout_seconds=config.hang_timeout_seconds,
            force=config.force,
        )
    except KeyboardInterrupt:
        raise StoppedBySignal(
            _stopped_message(config, signal.SIGINT, None, saved_states(out)[-1:]), signal.SIGINT
        ) from None
    except StoppedBySignal as stopped:
        raise StoppedBySignal(
            _stopped_message(config, stopped.signum, None, saved_states(out)[-1:]), stopped.signum
        ) from None
    except LaunchError as error:
        if DIVERGED_EXIT_CODE in error.exit_codes.values():
            raise TrainingDiverged("") from None  # rank 0 said why in one line
        raise
    metrics = json.loads((out / "metrics.json").read_text())
    print(
        f"dpkit train: {config.strategy} over {n_devices} processes done; final loss {metrics['loss'][-1]:.4f}, "
        f"{metrics['samples_per_second']:.0f} samples/s, test accuracy {metrics['test_accuracy']:.4f}"
    )
    return metrics


def _stopped_message(config: TrainConfig, signum: int, step: int | None, state: list[Path]) -> str:
    name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
    at = f" at step {step} of {config.steps}" if step is not None else ""
    if not state:
        how = (
            "checkpoint_every=K"
            if config.checkpoint_every is None
            else f"a state every {config.checkpoint_every} steps"
        )
        return f"stopped by {name}{at}; nothing saved yet ({how} saves state to resume from)"
    resume = config.resume_command or "the same training with resume=True"
    return f"stopped by {name}{at}; state saved in {state[-1]}; resume with: {resume}"


# --- stopping at a step boundary --------------------------------------------------------------------


class StopRequest:
    """SIGINT/SIGTERM ask the loop to stop after the current step (and save, with checkpoint_every); a
    second Ctrl-C stops at once."""

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
        saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
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
    prepared = prepared or prepare(config)
    out = Path(config.out)
    engine = Engine(
        strategy=config.strategy,
        accelerator=config.accelerator,
        devices=config.devices,
        precision=config.precision,
        accumulate=config.accumulate,
        progress=config.progress,
    )
    if engine.is_global_zero and not prepared.resume and config.overwrite and restart_count() == 0:
        _remove_run(out)

    def write_settings() -> None:
        # with the first saved state or the final model: a run that wrote nothing else leaves nothing behind
        if engine.is_global_zero and not (out / RUN_SETTINGS).exists():
            out.mkdir(parents=True, exist_ok=True)
            (out / RUN_SETTINGS).write_text(json.dumps(config.settings(), indent=2) + "\n")

    model, (x_train, y_train, x_test, y_test) = prepared.model, prepared.data
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    model, optimizer = engine.setup(model, optimizer)
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    train_data = TensorDataset(x_train, y_train)
    # the batch order comes from its own seeded generator: the same global batches for every strategy
    order = RandomSampler(train_data, generator=torch.Generator().manual_seed(config.seed))
    loader = engine.setup_dataloader(DataLoader(train_data, batch_size=config.batch_size, sampler=order))

    losses = LossLog(engine)
    step_seconds: list[float] = []
    seconds_before = 0.0
    if prepared.resume:
        extras = engine.load_state(out / STATE_FOLDER)
        losses = LossLog(engine, extras["losses"], extras["rows"])
        step_seconds, seconds_before = list(extras["step_seconds"]), float(extras["seconds"])
        if engine.step >= config.steps:
            raise ValueError(
                f"steps: the run in {str(out)!r} has already taken {engine.step} steps; give more than "
                f"{engine.step} to continue it"
            )

    micro_losses, micro_rows = [], 0
    steps_done = len(losses.losses)
    saved_path: Path | None = None
    stop = StopRequest()

    def save_state(seconds: float) -> Path:
        losses.reduce()
        write_settings()
        return engine.save_state(
            out / STATE_FOLDER,
            keep=config.keep,
            losses=list(losses.losses),
            rows=list(losses.rows),
            step_seconds=list(step_seconds),
            seconds=seconds,
        )

    try:
        with stop.installed():
            # said once the stop request is listening: a signal after this line stops at a step boundary
            engine.print(
                f"dpkit train: {config.model or config.example} with strategy {config.strategy} on "
                f"{engine.world_size} process(es), devices {', '.join(map(str, engine.devices))}, global batch "
                f"{config.batch_size}, precision {config.precision}"
                + (f", resuming at step {steps_done}" if prepared.resume else ""),
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
                        optimizer.step()
                        micro_losses.append(loss.detach().float() * len(y))
                        micro_rows += len(y)
                        if len(micro_losses) < config.accumulate:
                            continue
                        step_loss = torch.stack(micro_losses).sum().cpu()  # one optimizer step done
                        losses.add_step(step_loss, micro_rows)
                        micro_losses, micro_rows = [], 0
                        steps_done += 1
                        now = time.perf_counter()
                        step_seconds.append(now - step_started)
                        step_started = now
                        bar.update()
                        # every process stops at the same step: a signal or a non-finite loss on any one counts
                        flags = torch.tensor([float(stop.signum is not None), float(not torch.isfinite(step_loss))])
                        if engine.world_size > 1:
                            flags = engine.reduce(flags, "sum")
                        if flags[1] > 0:
                            raise TrainingDiverged(
                                f"lr: the loss became {float(step_loss):g} at step {steps_done} with "
                                f"lr={config.lr:g}; training stopped and wrote nothing from it; try a "
                                "smaller lr"
                            )
                        seconds = seconds_before + time.perf_counter() - started
                        if config.checkpoint_every and (
                            steps_done % config.checkpoint_every == 0 or flags[0] > 0 or steps_done == config.steps
                        ):
                            saved_path = save_state(seconds)
                        if flags[0] > 0:
                            signum = stop.signum if stop.signum is not None else signal.SIGTERM  # a peer was stopped
                            quiet = not engine.is_global_zero or relaunched()
                            message = _stopped_message(config, signum, steps_done, [saved_path] if saved_path else [])
                            raise StoppedBySignal("" if quiet else message, signum)
                        if steps_done == config.steps:
                            break
            finally:
                bar.close()
    except (StoppedBySignal, TrainingDiverged, KeyboardInterrupt):
        raise
    except Exception:
        if (
            stop.signum is not None
        ):  # a peer stopped first and its collective broke: the stop, not the error, is the news
            raise StoppedBySignal("", stop.signum) from None
        raise
    seconds = seconds_before + time.perf_counter() - started
    losses.reduce()
    samples_per_second = sum(losses.rows) / seconds if seconds > 0 else 0.0

    model.eval()
    test_loader = engine.setup_dataloader(DataLoader(TensorDataset(x_test, y_test), batch_size=256))
    correct = []
    with torch.no_grad():
        for x, y in test_loader:
            correct.append(engine.gather(model(x).argmax(dim=1) == y))
    correct = torch.cat(correct)

    write_settings()
    engine.save(model, out / "model.pt")
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
            "lr": config.lr,
            "loss": losses.losses,
            "samples_per_second": samples_per_second,
            "seconds": seconds,
            "median_step_seconds": sorted(step_seconds)[len(step_seconds) // 2],
            "test_accuracy": float(correct.float().mean()),
            "test_samples": int(correct.numel()),
            "resumed": prepared.resume,
        }
        # allow_nan=False: a nan that slipped through is an error here, never invalid JSON on disk
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2, allow_nan=False) + "\n")
        print(
            f"final loss {losses.losses[-1]:.4f}, {samples_per_second:.0f} samples/s, test accuracy "
            f"{metrics['test_accuracy']:.4f}; wrote {out / 'model.pt'} and {out / 'metrics.json'}",
            file=sys.stdout,
        )
    engine.close()
    return metrics
