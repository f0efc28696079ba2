"""Engine: one training loop for every strategy.

    engine = dpkit.Engine(strategy="replicated", accelerator="cpu", devices=2, precision="32")
    model, optimizer = engine.setup(model, optimizer)
    criterion = engine.setup_criterion(criterion)     # lets dp-balanced / replicated run the loss in replicas
    loader = engine.setup_dataloader(loader)          # the loader yields global batches
    for x, y in engine.progress(loader):
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        engine.backward(loss)
        optimizer.step()
    engine.save(model, "model.pt")

The batch size the loader yields is the global batch; every strategy turns one step into the same
gradient as one device running the whole batch. With `accumulate=k` each loader batch is a
micro-batch: `engine.backward` scales the loss by 1/k and skips the gradient exchange on the first k-1,
and `optimizer.step()` / `optimizer.zero_grad()` only act on the k-th, so the loop does not change.

`engine.save_state(folder)` / `engine.load_state(folder)` save and restore everything a stopped run needs
(weights, optimizers, engine.step, the loaders' positions, every generator; see docs/resume.md), so the
loop `while engine.step < steps: for x, y in loader: ...` resumes where it stopped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import torch
from torch import nn

from dpkit.checkpoint.model_files import unwrap_model
from dpkit.checkpoint.state import read_state_directory
from dpkit.checks import check_int
from dpkit.compilation import check_compile, check_cpp_compiler, take_compiled
from dpkit.devices import DeviceLike, keep_freed_host_memory
from dpkit.engine.among_processes import AmongProcesses
from dpkit.engine.auto_choice import choose_from_batch, choose_from_state
from dpkit.engine.background_save import BackgroundSaves, SaveHandle
from dpkit.engine.forward_batches import ForwardBatches
from dpkit.engine.item_weighting import ItemCount, check_items
from dpkit.engine.loop_checks import LossCheck, check_loss, check_setup
from dpkit.engine.placement import Placement, is_choice, resolve_placement
from dpkit.engine.process_streams import ProcessStream, check_uneven, stream_weight
from dpkit.engine.resumable_loader import ResumableLoader, resumable
from dpkit.engine.resume.load import LoaderPosition, load_training_state
from dpkit.engine.run_time_notes import PrintedLossNote
from dpkit.engine.together import agreed
from dpkit.engine.whole_model import load_whole_model, save_whole_model
from dpkit.engine.wrappers import (
    Accumulation,
    DeviceLoader,
    EngineCriterion,
    EngineModule,
    EngineOptimizer,
    SetUp,
    clip_gradients,
)
from dpkit.launch.heartbeat import busy
from dpkit.parallel.workers import hold_workers
from dpkit.precision import Precision
from dpkit.strategies import PER_DEVICE, Strategy, create_strategy, matching
from dpkit.strategies.compression import parse_compression

if TYPE_CHECKING:
    from dpkit.plan.auto import Choice

log = logging.getLogger("dpkit")


def compressing() -> list[str]:
    """The strategies that take some gradient compression."""
    return matching(lambda traits: len(traits.compressions) > 1)


class Engine(AmongProcesses):
    """Set up model, optimizer, criterion and loader for a strategy; backward, reduce, gather, save.

    Args:
        strategy: one of dpkit.strategies.available_strategies() (single, dp, dp-balanced, replicated, ddp,
            fsdp, zero, hsdp); "auto"
            (one device: single; under a launcher: ddp; several devices in one process: the model's first call
            chooses among the one-process strategies by dpkit.choose_strategy's rules, from the model, that
            batch and the devices, and prints its choice and the reason); or the Choice that
            dpkit.choose_strategy(model, inputs, batch_size, devices) returns (its reason is printed).
        accelerator: "cpu" (virtual CPU devices), "cuda" or "auto".
        devices: a count, a list ("cpu:0", 1, …) or "auto" (1 for single; all GPUs, else 2 CPU devices).
            Under ddp it is the number of processes per node, one device each.
        precision: "32", "bf16-mixed" or "16-mixed" (CUDA only).
        accumulate: micro-batches per optimizer step.
        progress: show tqdm bars from engine.progress (on rank 0 only).
        compile: True or a dict of torch.compile's options: the model's forward compiled, under every strategy
            (each replica runs it; fsdp, hsdp and zero stage 2 compile each innermost sharded module: the units, or
            the root of a model without units). A model compiled before setup keeps its own options.
            docs/compile.md says where it pays.
        compress: gradient compression, "none", "bf16", "fp16", "powersgd" or "powersgd:R" (docs/compression.md):
            16-bit under ddp, zero, fsdp, hsdp and replicated; PowerSGD (rank R, default 2) under ddp, zero stage 1
            and replicated, after compress_warmup_steps synchronized steps uncompressed (default 1,000).
        uneven: with per-process streams (setup_dataloader), what a rank that runs out of batches does: "join" (sit
            out the others' remaining steps with zero weight; the run finishes, rows weighted as one device on each
            step's present batches) or "stop" (every rank stops with one line naming it).
        **strategy_options: passed to the strategy, e.g. timeout_seconds= and seed= for ddp.

    Where it runs is resolved once (engine/placement.py) into `engine.placement`, a frozen value the
    strategy is built from; in-process "auto" replaces it by the decided one at the first batch.
    """

    def __init__(
        self,
        strategy: str | Choice = "single",
        accelerator: str = "auto",
        devices: int | str | Sequence[DeviceLike] = "auto",
        precision: str = "32",
        accumulate: int = 1,
        progress: bool = True,
        nonfinite_loss: str | None = None,
        compile: bool | Mapping[str, Any] | None = None,
        compress: str = "none",
        compress_warmup_steps: int | None = None,
        uneven: str = "join",
        **strategy_options: Any,
    ):
        check_int(accumulate, "accumulate", meaning="micro-batches per optimizer step")
        self.uneven = check_uneven(uneven)
        compression = parse_compression(compress, compress_warmup_steps)  # one line on a bad value, first
        if compression.compresses:
            if strategy == "auto" or is_choice(strategy):
                raise ValueError(
                    f"compress: {str(compression)!r} goes with a strategy named for it ({', '.join(compressing())}); "
                    "strategy='auto' chooses without compression"
                )
            strategy_options = {"compress": str(compression), **strategy_options}
            if compress_warmup_steps is not None:
                strategy_options["compress_warmup_steps"] = compress_warmup_steps
        self.compile_options = check_compile(compile)  # torch.compile's options, None for eager
        self._loss_check = LossCheck(nonfinite_loss)
        self.placement: Placement = resolve_placement(strategy, accelerator, devices, precision)
        check_cpp_compiler(self.compile_options, self.placement.device.type)  # before a process group exists
        if is_choice(strategy) and self.placement.rank == 0:
            print(strategy.reason, flush=True)
        if self.placement.device.type == "cpu":
            # before any step, so that every step runs alike: glibc would hand each freed activation back to the
            # kernel and page-fault it in again the next step (DPKIT_KEEP_HOST_MEMORY=0 leaves malloc alone)
            keep_freed_host_memory()
        self.precision = Precision(precision, self.placement.device.type)
        self._strategy_options = strategy_options
        self.strategy: Strategy = self._build_strategy()
        self.accumulate = accumulate
        self.show_progress = progress
        self._accumulation = Accumulation(accumulate)
        self._items = ItemCount()  # engine.backward(loss_sum, items=n): the window's count
        self._optimizers: list[EngineOptimizer] = []
        self._loaders: list[ResumableLoader] = []  # in setup order; their positions are part of the state
        self._batches = ForwardBatches()  # the batch in hand, and which batch each loss came from
        self._pending_loaders: list[LoaderPosition] = []  # positions loaded before their loader was set up
        self._model: EngineModule | None = None
        self._bare_model: nn.Module | None = None  # the user's model object (replica 0 / the DDP module)
        self._criteria: list[EngineCriterion] = []
        self._printed_loss = PrintedLossNote()  # engine.print of a process's own loss, said once
        # what the Engine changes for its lifetime, put back by close(): the replica runner's worker threads
        # (stopped when the last lease goes) and the intra-op thread count a loaded state set
        self._workers = hold_workers()
        self._threads_before_load: int | None = None
        self._streams = False  # a per-process stream was set up (its position is not saved: said once)
        self._saves = BackgroundSaves()  # the save in flight, and what saves held the loop
        if self.is_global_zero:
            log.debug("engine: %s, accumulate %d", self.placement, accumulate)

    def _build_strategy(self) -> Strategy:
        """The placement's strategy, built with its devices and precision, its process prepared."""
        placement = self.placement
        strategy = create_strategy(
            placement.strategy, list(placement.devices), precision=placement.precision, **self._strategy_options
        )
        if self.precision.scaler is not None and not strategy.traits.grad_scaler:
            able = ", ".join(matching(lambda traits: traits.grad_scaler))
            raise ValueError(
                f"precision: '16-mixed' is not supported with strategy '{placement.strategy}' yet; use "
                f"precision='bf16-mixed' or one of the strategies {able}"
            )
        # a strategy whose forward decides whether backward exchanges gradients (ddp) asks the accumulation window
        strategy.next_backward_syncs = lambda: self._accumulation.next_syncs()  # type: ignore[method-assign]
        strategy.setup_environment()
        return strategy

    # --- setup -------------------------------------------------------------------------------------
    @overload
    def setup(self, model: nn.Module) -> EngineModule: ...
    @overload
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[EngineModule, EngineOptimizer]: ...
    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> EngineModule | tuple[EngineModule, EngineOptimizer]:
        """(model, optimizer) wrapped for the strategy; build the optimizer from model.parameters() first.

        The wrapped model's state_dict() and load_state_dict() use `model`'s own keys under every strategy; the
        wrapped optimizer is a torch.optim.Optimizer (torch's LR schedulers take it)."""
        check_setup(model, optimizer, set_up_before=self._model is not None)
        # compiled before setup or with compile=: the strategy gets the bare module (clean keys) and compiles it
        model, compile_fn = take_compiled(model, self.compile_options)
        if compile_fn is not None:
            self.strategy.compile_model(model, compile_fn)
        self._bare_model = model
        self._model = EngineModule(self.strategy.wrap_model(model), self.precision, self.strategy, model)
        self._model.__dict__["forward_ran"] = self._batches.forward_ran
        if self.placement.undecided:
            self._model.__dict__["decide"] = self._decide_from_batch
        if optimizer is None:
            return self._model
        engine_optimizer = EngineOptimizer(
            self.strategy.wrap_optimizer(optimizer), self._accumulation, self.precision, given=optimizer
        )
        self._optimizers.append(engine_optimizer)
        return self._model, engine_optimizer

    # --- strategy="auto" on several devices: decided by the first batch, or by a loaded state --------------------
    def _decide_from_batch(self, args: tuple, kwargs: dict) -> None:
        """The model's first call: choose the strategy from the model, this batch and the devices, say it, and
        set it up in place of the reference."""
        if not self.placement.undecided or self._bare_model is None:  # (the first batch decides once, after setup)
            return
        optimizer = self._optimizers[0].given if self._optimizers else "sgd"
        placement, reason = choose_from_batch(
            self.placement, self._bare_model, args, kwargs, optimizer, grad_scaler=self.precision.scaler is not None
        )
        print(reason, flush=True)
        self._adopt(placement)

    def _adopt(self, placement: Placement) -> None:
        """Set up the decided placement's strategy in place of the reference that ran until the decision: the
        model, the optimizers, the criteria and the loaders set up so far follow it."""
        if self._model is None:  # (adopted from engine.setup on)
            raise RuntimeError("engine: strategy 'auto' decides after engine.setup(model, optimizer)")
        self._model.__dict__.pop("decide", None)
        same = placement.strategy == self.placement.strategy and len(placement.devices) == len(self.placement.devices)
        self.placement = placement
        if same:
            return
        self.strategy = self._build_strategy()
        followers: list[EngineModule | EngineOptimizer | EngineCriterion] = [self._model, *self._optimizers]
        for wrapper in [*followers, *self._criteria]:
            wrapper.follow(self.strategy)
        for loader in self._loaders:
            loader.rule = self.strategy  # one-process strategies share the data rule: only the loss weight is read

    def setup_criterion(self, criterion: Callable) -> Callable:
        """The criterion to call as criterion(model(x), y); under dp-balanced and replicated it runs the
        forward and the loss inside the replicas. Elsewhere it is `criterion`, announced as the "loss" phase."""
        if not callable(criterion):
            raise TypeError(
                f"criterion: expected a callable loss such as nn.CrossEntropyLoss(), got {type(criterion).__name__}"
            )
        if self._model is None:
            raise RuntimeError("engine.setup_criterion: call engine.setup(model, optimizer) first")
        engine_criterion = EngineCriterion(criterion, self.strategy, self.precision)
        self._criteria.append(engine_criterion)  # it follows the strategy "auto" decides later
        return engine_criterion

    def setup_dataloader(self, loader: Iterable) -> Iterable:
        """The loader to iterate.

        A torch DataLoader over a map-style dataset yields global batches (under a strategy with a process per
        device, each process gets its share of each) and comes back as a loader whose position (epoch, next batch)
        is part of engine.save_state. Under a strategy with a process per device any other iterable (a DataLoader
        over an IterableDataset, a shard of files) is this process's own stream: each step's global batch is the
        union of what the processes yield, rows weighted, and uneven ends are handled as `uneven=` says
        (engine/process_streams.py); its position is its own to resume. Under the one-process strategies other
        iterables come back unchanged, their batches global, not tracked.
        """
        if resumable(loader):
            loader = ResumableLoader(loader, self.strategy, on_batch=self._batches.batch_yielded)
        elif self.strategy.traits.processes == PER_DEVICE:
            loader = ProcessStream(
                loader,
                self.strategy,
                self.uneven,
                on_batch=self._batches.batch_yielded,
                training=self._training,
                on_end=self._batches.stream_ended,
            )
            self._streams = True
        if isinstance(loader, ResumableLoader):
            index = len(self._loaders)
            self._loaders.append(loader)
            if index < len(self._pending_loaders):  # engine.load_state ran before this loader was set up
                position, order_state = self._pending_loaders[index]
                loader.check_position(position, f"loaders[{index}]")
                loader.resume_from(position, order_state)
        if self.device.type != "cpu":
            loader = DeviceLoader(loader, self.device)
        return loader

    # --- the step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *, items: int | float | torch.Tensor | None = None) -> None:
        """loss.backward() for the strategy: sample-weighted, accumulated, reduced across devices.

        items: `loss` is a sum over this many items (tokens, rows) of the micro-batch this process's loop sees;
        the step's gradient is then that of all such sums over every device and micro-batch of the step divided
        by their total count (engine/item_weighting.py). Give it on every backward of a step or on none."""
        check_loss(loss)
        self._printed_loss.backward(loss)
        # off by default: the check reads the loss's value each step (a device sync, and a collective across
        # processes so that every process stops at the same step)
        window = self._accumulation.micro_batches % self.accumulate + 1  # this backward's place in its window
        self._loss_check(loss, self.strategy, step=self.step + 1, micro_batch=window, accumulate=self.accumulate)
        counted = None if items is None else check_items(items)
        # the batch the loss came from, whatever the loop fetched since (checked before counting)
        record = self._batches.loss_record(loss)
        if record is not None:
            self.strategy.rows_trained(record.rows)
        if record is not None and record.from_stream:
            scale, counted = stream_weight(record, counted, self._items, self.strategy)
            sync = self._accumulation.add_micro_batch()
        else:
            weight = record.loss_weight if record is not None and counted is None else 1.0
            self._items.add(counted)
            sync = self._accumulation.add_micro_batch()
            if counted is None:
                scale = weight / self.accumulate
            else:  # a sum: the step divides by the whole count; a strategy that runs the loss in replicas adds theirs
                scale = self.strategy.sum_weight()
                self.strategy.loss_is_sum()
        self.strategy.backward(self.precision.scale_loss(loss), scale=scale, sync=sync)
        if sync and self._model is not None:
            self._items.finish(self.strategy, self._model, self.accumulate)

    def _training(self) -> bool:
        """Whether the model set up trains now (train mode), for a stream's shadow batches."""
        return self._model is None or self._model.training

    @property
    def in_shadow_step(self) -> bool:
        return self._batches.in_shadow

    def print(self, *args: object, **kwargs: Any) -> None:
        """print(), on rank 0 only; a loss printed under a strategy with a process per device is said, once, to be
        this process's (engine/run_time_notes.py)."""
        if self.is_global_zero:
            self._printed_loss.printing(self.strategy, self.world_size, args)
        super().print(*args, **kwargs)

    @property
    def step(self) -> int:
        """Optimizer steps taken through the Engine's optimizer (restored by load_state)."""
        return self._accumulation.steps

    @property
    def window_complete(self) -> bool:
        """Whether the last engine.backward completed an accumulation window: the next optimizer.step() steps
        (clip the gradients now)."""
        return bool(self._accumulation.complete)

    # --- metrics across processes ------------------------------------------------------------------
    def clip_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ for the gradients the next `optimizer.step()` applies, under every strategy
        and precision (16-mixed unscales first; replicas that step themselves are clipped alike; a sharded model's
        norm is the whole model's). Call it after the last micro-batch's backward; returns the norm before
        clipping, the same on every device and process."""
        if self._model is None or not isinstance(optimizer, EngineOptimizer):
            raise RuntimeError("engine.clip_gradients: pass the optimizer engine.setup(model, optimizer) returned")
        return clip_gradients(self.strategy, self._model, optimizer, self.precision, max_norm, norm_type)

    def model_copies(self) -> list[tuple[nn.Module, torch.device]]:
        """(module, device) for every copy of the model this process keeps between steps: a strategy's
        persistent replicas where it has them (replicated), else the set-up model on this process's device."""
        if self._bare_model is None:
            raise RuntimeError("engine.model_copies: call engine.setup(model, optimizer) first")
        return self.strategy.model_copies(self._bare_model)

    def save(self, model: nn.Module, path: str | os.PathLike) -> None:
        """Rank 0 writes the clean state dict (as dpkit.save_model); every process calls it and waits for it."""
        save_whole_model(self.strategy, model, path)

    def load(self, path: str | os.PathLike) -> nn.Module:
        """Load a checkpoint (clean or prefixed) into the set-up model, in every process and every replica."""
        if self._bare_model is None or self._model is None:
            raise RuntimeError("engine.load: call engine.setup(model, optimizer) first")
        load_whole_model(self.strategy, self._bare_model, path)
        return self._model

    # --- resumable training state ------------------------------------------------------------------------
    def save_state(
        self, directory: str | os.PathLike, *, keep: int | None = 3, blocking: bool = True, **extra: Any
    ) -> Path | SaveHandle:
        """Save everything a resumed run needs into `directory`/step-NNNNNNNN, and point `directory`/latest at it.

        Holds the model (clean keys), the optimizers, the GradScaler, engine.step, the position of every
        loader from engine.setup_dataloader, every process's generator states, and `extra` (plain values,
        tensors, or objects with state_dict(), such as an LR scheduler). Keeps the newest `keep` states.
        Every process must call it (under ddp it is a collective); call it between optimizer steps.
        Returns the step directory written. With blocking=False the state is copied now and written in the
        background (engine/background_save.py): it returns a SaveHandle (`.wait()` gives the step directory,
        `.done()`), at most one save is in flight (the next save, load_state, close and the process's exit wait
        for it), and a failed write is raised at the next of those.
        """
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking: expected True (written before save_state returns) or False, got {blocking!r}")
        set_up = self._set_up("engine.save_state")
        if self._streams and self.is_global_zero:
            log.warning(
                "engine.save_state: a per-process stream's position is not part of the state; a resume starts your "
                "iterable where you make it start (skip what was used, or use a loader that saves its own position)"
            )
            self._streams = False  # said once
        with busy("saving the training state"):  # a slow save is progress, not a hang (dpkit.launch.busy)
            return self._saves.save(set_up, directory, keep=keep, extra=extra, blocking=blocking)

    def wait_for_saves(self) -> Path | None:
        """Wait for the background save in flight, if any (its step directory; its error raised here)."""
        with busy("waiting for the training state's save"):
            return self._saves.finish()

    def abandon_saves(self) -> int | None:
        """Give up the background save in flight unless its commit is made already (a stop that cannot wait): the
        step given up, or None. The newest state on disk is settled when it returns."""
        return self._saves.abandon()

    @property
    def saves(self) -> int:
        """The training states saved so far (background and blocking)."""
        return self._saves.saves

    @property
    def save_blocking_seconds(self) -> float:
        """How long saves held the loop so far: staging the background ones, writing the blocking ones, waiting."""
        return self._saves.blocking_seconds

    def load_state(self, directory: str | os.PathLike, **objects: Any) -> dict[str, Any]:
        """Restore what save_state saved (from `directory`/latest, or a step directory); returns the extras.

        Objects passed by name (e.g. scheduler=scheduler) get their saved state through load_state_dict.
        All or nothing: everything is read and checked first (the model's keys and shapes, every optimizer's
        class, param groups and per-parameter state, every named object's kind, the loaders), and if a
        load_state_dict still fails, what was already loaded is put back, so a failed load leaves the model,
        optimizers, objects, engine.step, loaders and generators as they were. A state saved under another
        strategy or world size loads too: the data position counts global batches, which every strategy shares.
        After it, iterating the Engine's loaders continues the saved epoch from the saved batch.
        FileNotFoundError means that `directory` holds no state; a damaged one is a CheckpointCorruptError.
        """
        self.wait_for_saves()  # (a state being written is read once it is whole)
        with busy("loading the training state"):
            return self._load_state(directory, **objects)

    def _load_state(self, directory: str | os.PathLike, **objects: Any) -> dict[str, Any]:
        self._set_up("engine.load_state")  # set up first
        # read onto the CPU: load_state_dict moves weights and optimizer state to their parameters' devices
        # every process reads its own rank-R.pt: one that fails makes every process fail with its line (together.py)
        chosen, shared, mine = agreed(
            self.strategy, lambda: read_state_directory(directory, self.rank, map_location="cpu")
        )
        if self.placement.undecided:  # resume with the strategy the state was saved under, when this process can
            placement, reason = choose_from_state(
                self.placement, shared.get("strategy"), chosen, grad_scaler=self.precision.scaler is not None
            )
            if reason:
                print(reason, flush=True)
                self._adopt(placement)
        set_up = self._set_up("engine.load_state")  # (with the strategy "auto" may just have adopted)
        threads = torch.get_num_threads()
        extras, self._pending_loaders = load_training_state(set_up, chosen, shared, mine, objects)
        if torch.get_num_threads() != threads and self._threads_before_load is None:
            self._threads_before_load = threads
        return extras

    def _set_up(self, call: str) -> SetUp:
        """What this engine set up, as a training state saves and restores it (`call` needs it set up)."""
        if self._bare_model is None:
            raise RuntimeError(f"{call}: call engine.setup(model, optimizer) first")
        parts = (self._optimizers, self._loaders, self._accumulation, self.strategy, self.precision, self.devices)
        return SetUp(unwrap_model(self._bare_model), *parts)

    def close(self) -> None:
        """Release the strategy's resources (the process group under ddp) and what the Engine held in the process:
        its lease on the replica runner's worker threads, the intra-op thread count a loaded state set. A save in
        flight is written first (its error raised after the rest is released)."""
        try:
            self.wait_for_saves()
        finally:
            self._close()

    def _close(self) -> None:
        self.strategy.teardown()
        self._workers.release()
        if self._threads_before_load is not None:
            torch.set_num_threads(self._threads_before_load)
            self._threads_before_load = None
