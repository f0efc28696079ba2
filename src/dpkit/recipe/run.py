"""One recipe run in this process, as a `Run`: the Engine made from the config, the model, optimizer and data
set up, the saved state loaded (or the old run removed), then the loop: steps, evaluations, saved states,
stops at a step boundary, and the final files. Every value the run carries is an attribute, every phase a
method, so a reader follows the data from the config to the files top to bottom.

The accumulation boundary is the Engine's: the Engine counts the micro-batches of a window, and a step is
taken when its optimizer steps (engine.step moves).
"""

from __future__ import annotations

import math
import signal
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from dpkit.checkpoint.errors import CheckpointCorruptError
from dpkit.checkpoint.steps import step_of
from dpkit.compilation import compile_counts, describe_compile
from dpkit.devices import available_cores
from dpkit.engine.engine import Engine
from dpkit.errors import said_by_every_rank
from dpkit.launch import StoppedBySignal, relaunched
from dpkit.observe.collectives import RECORD
from dpkit.recipe.checks import Plan, Prepared
from dpkit.recipe.config import BEST_BY, TrainConfig, TrainingDiverged, describe_compression
from dpkit.recipe.earlier_state import resume_source, with_earlier_state
from dpkit.recipe.evaluation import Best, Scores, evaluate
from dpkit.recipe.folder import (
    BEST,
    BEST_MODEL,
    MODEL,
    RUN_SETTINGS,
    STATE_FOLDER,
    best_files,
    newest_state,
    remove_run,
    restore_best_files,
    say_finished,
    write_json,
)
from dpkit.recipe.metrics import StepRecords, write_summary
from dpkit.recipe.optimization import build_optimizer, schedule_at
from dpkit.recipe.save_memory import check_save_memory, staged_copy
from dpkit.recipe.stop import StopRequest, stopped_message
from dpkit.recipe.streams import Streams, evaluate_stream


class Run:
    """A recipe run in this process (one of the strategy's processes under a launcher)."""

    def __init__(self, config: TrainConfig, prepared: Prepared):
        self.config = config
        self.out = Path(config.out)
        self.engine = Engine(
            strategy=config.strategy,
            accelerator=config.accelerator,
            devices=config.devices,
            precision=config.precision,
            accumulate=config.accumulate,
            progress=config.progress,
            compile=config.compile,
            **config.strategy_options(),
        )
        if self.engine.device.type == "cpu" and not self.engine.placement.per_device:
            # the intra-op threads decide how large sums are split, so the run's count comes from the machine,
            # never from what the process ran before (a process per device has its share already); a resume
            # takes the state's count (engine.load_state)
            torch.set_num_threads(available_cores())
        # rank 0 decided what to do with the folder; the others learn it here
        self.plan = cast(Plan, self.engine.gather_object(prepared.plan)[0])  # (rank 0's is never None)
        # the bytes this process put into collectives over the run (metrics.json's communication_bytes): what the
        # record counts from here, with what a resumed run's earlier parts counted
        self.bytes_at_start, self.bytes_restored = RECORD.total_bytes, 0
        self.prepared = prepared
        # sized from the model as built, whole: a sharded strategy's setup leaves this process its shards only
        self.staged_copy = staged_copy(prepared.model, config.optimizer, config.momentum)
        self.stop = StopRequest()
        self.best = Best(config.keep_best, BEST_BY[config.keep_best]) if config.keep_best else None
        self.records = StepRecords(self.engine)
        self.steps_done = 0
        self.first_step = 0  # the step this run began at (set again after a resume)
        self.saved_path: Path | None = None  # the state this run saved last
        self.window_losses: list[torch.Tensor] = []  # the accumulation window's loss sums and rows so far
        self.window_rows = 0
        self.started = self.step_started = 0.0

    def execute(self) -> dict[str, Any] | None:
        """Train to config.steps and write the final files; the metrics on rank 0 (None on the others)."""
        if self.plan.finished:
            self.engine.close()
            return say_finished(self.out, self.config.steps) if self.engine.is_global_zero else None
        self._set_up()
        self._resume_or_replace()
        self.steps_done = len(self.records.losses.losses)
        self.first_step = self.steps_done  # a state past it was saved by this run
        # the rate of the next step comes from the schedule at this step (a resumed run's changes included)
        config = self.config
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's "scheduler before optimizer" guess does not apply
            self.scheduler = schedule_at(
                self.base_optimizer, config.lr, config.schedule, config.steps, config.lr_warmup_steps, self.steps_done
            )
        self.records.open_log(self.out, config, self.plan.resume, self.engine.is_global_zero)
        metrics = None
        try:
            with self.stop.installed():
                self._say_start()
                self._train_steps()
                metrics = self._finish()
        except KeyboardInterrupt:  # a second Ctrl-C: at once, the save in flight given up unless committed
            raise self._interrupted() from None
        except (StoppedBySignal, TrainingDiverged):
            raise
        except Exception:
            if self.stop.signum is not None:  # a peer stopped first and its collective broke: the stop is news
                raise StoppedBySignal("", self.stop.signum) from None
            raise
        finally:
            self.records.close()
        self.engine.close()
        return metrics

    # --- before the first step ---------------------------------------------------------------------

    def _set_up(self) -> None:
        config, engine = self.config, self.engine
        model, data = self.prepared.model, self.prepared.data
        self.base_optimizer = build_optimizer(
            config.optimizer, model.parameters(), config.lr, config.momentum, config.weight_decay
        )
        self.model, self.optimizer = engine.setup(model, self.base_optimizer)
        # a sum over each micro-batch's rows, weighted by engine.backward(loss, items=rows): the step's gradient is
        # that of the mean over all its rows, however they are split over devices, micro-batches and processes
        self.criterion = engine.setup_criterion(nn.CrossEntropyLoss(reduction="sum"))
        self.test_stream: Iterable | None = None
        if isinstance(data, Streams):  # this process's own streams (recipe/streams.py)
            train_stream, self.test_stream = data.for_this_process(config.seed)
            self.loader = engine.setup_dataloader(train_stream)
            return
        x_train, y_train, self.x_test, self.y_test = data
        train_data = TensorDataset(x_train, y_train)
        # the batch order comes from its own seeded generator: the same global batches for every strategy
        order = RandomSampler(train_data, generator=torch.Generator().manual_seed(config.seed))
        self.loader = engine.setup_dataloader(DataLoader(train_data, batch_size=config.batch_size, sampler=order))

    def _resume_or_replace(self) -> None:
        config, engine, out = self.config, self.engine, self.out
        if self.plan.resume:
            extras = self._load_state()
            self.bytes_restored = int(extras.get("communication_bytes", 0))
            self.records = StepRecords(
                engine, extras["losses"], extras["rows"], extras["step_seconds"], float(extras["seconds"])
            )
            if self.best is not None and config.keep_best is not None:  # (best is kept when keep_best is given)
                self.best = Best(config.keep_best, BEST_BY[config.keep_best], extras.get("best"))
            if engine.step > config.steps:
                raise said_by_every_rank(
                    ValueError(
                        f"steps: the run in {str(out)!r} has already taken {engine.step} steps; give {engine.step} "
                        "to finish it or more to continue it"
                    )
                )
            if self.best is not None and engine.is_global_zero and "best_files" in extras:
                # what a later, discarded part of the run wrote there is not this run's best
                restore_best_files(out, extras["best_files"])
        # before any step and before an old run goes; after a load, which says the step the saves count from
        check_save_memory(config, self.staged_copy, engine.strategy, engine.placement, engine.step)
        if self.plan.remove:
            # every process is here, so every process passed every check (its own, the Engine's, the setup's):
            # only now does the old run go
            engine.barrier()
            if engine.is_global_zero:
                remove_run(out)
            engine.barrier()

    def _load_state(self) -> dict[str, Any]:
        """The saved state loaded. Its errors are every process's alike (the Engine's processes agree before any
        fails), said once by rank 0; a damaged state's names the command that resumes from the one before it."""
        try:
            return self.engine.load_state(resume_source(self.config))
        except CheckpointCorruptError as error:
            raise said_by_every_rank(with_earlier_state(error, self.config)) from error

    def _say_start(self) -> None:
        """Said once the stop request is listening: a signal after this line stops at a boundary."""
        config, engine, plan, steps_done = self.config, self.engine, self.plan, self.steps_done
        batch = f"global batch {config.batch_size}"
        if config.accumulate > 1:  # --batch-size is each micro-batch's: a step takes `accumulate` of them
            batch += f" x {config.accumulate} micro-batches = {config.batch_size * config.accumulate} samples per step"
        engine.print(
            f"dpkit train: {config.model or config.example} with strategy {engine.strategy.layout()} on "
            f"{engine.world_size} process(es), devices {', '.join(map(str, engine.devices))}, {batch}, "
            f"{config.optimizer} lr {config.lr:g} ({config.schedule}"
            + (f", {config.lr_warmup_steps} warm-up steps" if config.lr_warmup_steps else "")
            + ")"
            + (f", clip {config.clip_grad_norm:g}" if config.clip_grad_norm else "")
            + describe_compression(config)
            + f", precision {config.precision}"
            + (f", resuming at step {steps_done}" if plan.resume else "")
            + (f" from {config.resume_from}" if plan.resume and config.resume_from else "")
            + "".join(
                f"; {c['setting']} {c['from']!r} -> {c['to']!r}"
                for c in plan.changes
                if plan.resume and c["step"] == steps_done
            )
            + (" (all steps taken: evaluating and writing the final files)" if steps_done >= config.steps else ""),
            flush=True,
        )

    # --- the loop ----------------------------------------------------------------------------------

    def _train_steps(self) -> None:
        bar = self.engine.progress(total=self.config.steps, initial=self.steps_done, desc="training", unit="step")
        self.started = self.step_started = time.perf_counter()
        try:
            while self.steps_done < self.config.steps:
                for x, y in self.loader:
                    step = self._micro_batch(x, y)
                    if step is not None:
                        bar.update()
                        if self._after_step(*step):
                            break
        finally:
            bar.close()

    def _micro_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        """Forward and backward one micro-batch; at the end of its accumulation window, clip and step. The step's
        loss sum and learning rate when a step was taken, else None."""
        config, engine, optimizer = self.config, self.engine, self.optimizer
        optimizer.zero_grad()
        loss = self.criterion(self.model(x), y)
        engine.backward(loss, items=len(y))
        self.window_losses.append(loss.detach().float())
        self.window_rows += len(y)
        norm = None
        if config.clip_grad_norm is not None and engine.window_complete:
            norm = float(engine.clip_gradients(optimizer, config.clip_grad_norm))
        lr = self.base_optimizer.param_groups[0]["lr"]
        steps_before = engine.step
        optimizer.step()
        if engine.step == steps_before:
            return None  # still accumulating: the Engine's optimizer steps at the end of the window
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a strategy may step copies of the optimizer
            self.scheduler.step()
        step_loss = torch.stack(self.window_losses).sum().cpu()
        self.steps_done += 1
        now = time.perf_counter()
        self.records.step_taken(self.steps_done, step_loss, self.window_rows, lr, norm, now - self.step_started)
        self.step_started = now
        self.window_losses, self.window_rows = [], 0
        return step_loss, lr

    def _after_step(self, step_loss: torch.Tensor, lr: float) -> bool:
        """Divergence, metrics rows, evaluation, saved state and stops after a step; whether the run is done."""
        config, steps_done = self.config, self.steps_done
        # every process stops at the same step: a signal or a non-finite loss on any one counts
        stopping, diverged = self._agreed(self.stop.signum is not None, not torch.isfinite(step_loss))
        if diverged:
            raise self._diverged(f"the loss became {float(step_loss):g}", lr)
        if steps_done % config.log_every == 0:
            self.records.write_rows()
        if config.eval_every and steps_done % config.eval_every == 0 and steps_done < config.steps:
            self.records.write_rows()
            self._evaluate(f"in the evaluation at step {steps_done}")
        if config.checkpoint_every and (
            steps_done % config.checkpoint_every == 0 or stopping or steps_done == config.steps
        ):
            # in the background between them (unless sync_checkpoints); a stop's save and the last one block, so
            # that the line said at the end names a state that is whole
            last = stopping or steps_done == config.steps
            self._save_state(self._seconds(), blocking=config.sync_checkpoints or last)
        if stopping:
            raise self._stopped()
        return steps_done == config.steps

    def _seconds(self) -> float:
        return self.records.seconds_before + time.perf_counter() - self.started

    def _agreed(self, *flags: bool) -> list[bool]:
        """Whether any process raised each flag: every process stops at the same point."""
        tensor = torch.tensor([float(flag) for flag in flags])
        if self.engine.world_size > 1:
            tensor = self.engine.reduce(tensor, "sum")
        return [bool(value > 0) for value in tensor]

    def _stop_agreed(self) -> bool:
        """Whether any process was asked to stop (asked after every evaluation batch, by every process)."""
        return self._agreed(self.stop.signum is not None)[0]

    def _diverged(self, what: str, lr: float) -> TrainingDiverged:
        return TrainingDiverged(
            f"lr: {what} at step {self.steps_done} with lr={lr:g}; training stopped and wrote nothing from it; try a "
            "smaller lr" + (" or clip_grad_norm=1" if self.config.clip_grad_norm is None else "")
            if self.engine.is_global_zero
            else ""  # rank 0 says it once
        )

    def _stopped(self, during: str = "") -> StoppedBySignal:
        signum = self.stop.signum if self.stop.signum is not None else signal.SIGTERM  # a peer was stopped
        finished = self.engine.wait_for_saves()  # a background save in flight is whole first (a stop in evaluation)
        self.saved_path = finished or self.saved_path
        quiet = not self.engine.is_global_zero or relaunched()
        newest = self.saved_path or newest_state(self.out)
        message = stopped_message(self.config, signum, self.steps_done, self.saved_path, newest, during)
        return StoppedBySignal("" if quiet else message, signum)

    def _interrupted(self) -> StoppedBySignal:
        """The stop line of a run stopped at once: its newest whole state (a background save not yet committed is
        given up: checkpoint/writes.py never commits it)."""
        abandoned = self.engine.abandon_saves()
        during = f"the background save of step {abandoned} given up" if abandoned is not None else ""
        newest = newest_state(self.out)
        this_run = newest is not None and (step_of(newest) or 0) > self.first_step
        saved = newest if abandoned is None and this_run else None
        quiet = not self.engine.is_global_zero or relaunched()
        message = stopped_message(self.config, signal.SIGINT, self.steps_done, saved, newest, during)
        return StoppedBySignal("" if quiet else message, signal.SIGINT)

    # --- what the run writes -------------------------------------------------------------------------

    def _evaluate(self, during: str) -> Scores:
        """Loss and accuracy on the test data; a row in metrics.csv, and best.pt and best.json when it is the
        best so far. A non-finite figure is divergence, stopped before anything is written from it."""
        engine = self.engine
        if self.test_stream is not None:
            scores: Scores | None = Scores(*evaluate_stream(engine, self.model, self.test_stream))
        else:
            scores = evaluate(engine, self.model, self.x_test, self.y_test, self._stop_agreed)
        if scores is None:
            raise self._stopped(during)
        if not (math.isfinite(scores.loss) and math.isfinite(scores.accuracy)):
            # every process has the same figures, so every one stops here, before any file is written from them
            what = f"the evaluation loss became {scores.loss:g} (accuracy {scores.accuracy:g})"
            raise self._diverged(what, self.base_optimizer.param_groups[0]["lr"])
        self.records.evaluated(self.steps_done, scores)
        best = self.best
        if best is not None and best.improves(scores):  # the same figures everywhere: every process agrees
            best.take(self.steps_done, scores)
            engine.save(self.model, self.out / BEST_MODEL)
            if engine.is_global_zero:
                write_json(self.out / BEST, {**best.record(), "loss": scores.loss, "accuracy": scores.accuracy})
        return scores

    def _write_settings(self) -> None:
        """run.json, with the first saved state or the final model (a run that wrote nothing else leaves nothing
        behind), and again with every later one: it says what the run is now, its changes included."""
        engine = self.engine
        if engine.is_global_zero:
            where = {
                "strategy": self.config.strategy,
                "devices": [str(d) for d in engine.devices],
                "processes": engine.world_size,
                # how, not what: a resumed run may compile or not (the checkpoints are the same either way)
                "compile": describe_compile(engine.compile_options),
            }
            if engine.compile_options is not None:
                where["compile_counts"] = compile_counts().as_dict()  # this process's compiles so far
            settings = {**self.config.settings(), **where, "job": self.plan.job, "changes": list(self.plan.changes)}
            write_json(self.out / RUN_SETTINGS, settings)

    def _save_state(self, seconds: float, blocking: bool = True) -> None:
        self.records.write_rows()
        self._write_settings()
        finished = self.engine.wait_for_saves()  # the one in flight: whole now (or its error raised here)
        if finished is not None:
            self.saved_path = finished
        saved = self.engine.save_state(
            self.out / STATE_FOLDER,
            keep=self.config.keep,
            blocking=blocking,
            **self.records.saved(),
            seconds=seconds,
            communication_bytes=self._communication_bytes(),
            settings={**self.config.settings(), "job": self.plan.job},
            best=self.best.record() if self.best is not None else None,
            # best.pt and best.json as they are at this step: a resume from here rolls them back to them
            best_files=best_files(self.out) if self.best is not None and self.engine.is_global_zero else None,
        )
        if isinstance(saved, Path):
            self.saved_path = saved

    def _finish(self) -> dict[str, Any] | None:
        """The final evaluation and files: a stop that arrives now lets them be written (each whole or not at
        all)."""
        seconds = self._seconds()
        self.records.write_rows()
        scores = self._evaluate("in the final evaluation")
        self._write_settings()
        self.engine.save(self.model, self.out / MODEL)
        if not self.engine.is_global_zero:
            return None
        return write_summary(
            self.config,
            self.engine,
            self.plan,
            self.records,
            scores,
            self.best,
            seconds,
            communication_bytes=self._communication_bytes(),
        )

    def _communication_bytes(self) -> int:
        return self.bytes_restored + RECORD.total_bytes - self.bytes_at_start
