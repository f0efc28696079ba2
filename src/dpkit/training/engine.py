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

import copy
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._pytree import tree_map_only
from torch.utils.data import DataLoader
from tqdm import tqdm

from dpkit.checks import check_int, check_number
from dpkit.devices import DeviceLike, keep_freed_host_memory, resolve_devices
from dpkit.launch import launched
from dpkit.launch.heartbeat import busy
from dpkit.parallel import hooks
from dpkit.parallel.nested import leaves, map_leaves
from dpkit.plan.auto import Choice, choose_strategy
from dpkit.precision import Precision
from dpkit.strategies import (
    PER_DEVICE,
    DeferredOutput,
    Strategy,
    create_strategy,
    matching,
    reference,
    strategy_class,
)
from dpkit.strategies.named_state import numbered_optimizer_state
from dpkit.strategies.replica_optimizers import ELEMENTWISE
from dpkit.training.checkpoint import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    check_state_dict,
    detached_on_cpu,
    read_model_file,
    save_state_dict,
    strip_prefixes,
    unwrap_model,
)
from dpkit.training.loop_checks import NONFINITE_LOSS, NonFiniteLoss, check_optimizer_of
from dpkit.training.shards import (
    check_shard_shapes,
    load_into,
    read_whole,
    verify_shards,
)
from dpkit.training.state import (
    STATE_FORMAT,
    BatchRecord,
    ResumableLoader,
    capture_rng,
    check_keep,
    check_rng,
    kind_of,
    pack_extras,
    read_state_directory,
    restore_rng,
    resumable,
    same_kind,
    short_kind,
    write_state_directory,
)

log = logging.getLogger("dpkit")

UNDECIDED = "auto, from the first batch"  # _resolve_auto's answer for several devices in one process


class EngineModule(nn.Module):
    """The strategy's model, run under the precision's autocast.

    Its state dict is the user's module's under every strategy, as Lightning Fabric's wrapper gives it:
    state_dict() has the keys (and runs the state-dict hooks) of the module given to engine.setup, so
    `torch.save(model.state_dict(), path)` writes a file the bare module loads; load_state_dict() takes such a
    state dict and loads it into what the strategy trains, every copy of it (see load_state_dict). Under a
    sharded strategy the values are this process's shards (DTensors): engine.save writes the whole model.
    parameters() and named_parameters() are the wrapper's own, as for torch's wrappers (names with `module.`).
    """

    wraps_module = True  # dpkit.unwrap_model / save_model look inside
    loads_every_copy = True  # dpkit.load_model loads through it, so every replica follows
    user_module: nn.Module  # in __dict__ (see __init__)

    def __init__(self, module: nn.Module, precision: Precision, strategy: Strategy, user_module: nn.Module):
        super().__init__()
        self.module = module
        self.precision = precision
        self.strategy = strategy
        # the module given to engine.setup, which the strategy trains (replica 0, DataParallel's or DDP's module, the
        # sharded module); kept out of nn.Module's registry so that its parameters are not listed twice
        self.__dict__["user_module"] = user_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        decide = self.__dict__.get("decide")
        if decide is not None:  # strategy="auto" on several devices: chosen from the first batch
            decide(args, kwargs)
        # the strategy announces its forward through the observation seam (dpkit.parallel.hooks)
        with self.precision.autocast(), self.strategy.forward_context(args, kwargs):
            return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The user's module's state dict: its keys, whatever the strategy wrapped it in."""
        return self.user_module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict keyed as the user's module names them (a bare model's) into what the strategy trains.

        torch's semantics: `strict`, and the result's missing_keys / unexpected_keys, are the user's module's.
        Every copy follows: replicated's other replicas copy the first (also when torch raises after loading the
        keys that matched); under dp and dp-balanced the loaded module is the one replicated at every step; under
        ddp and fsdp each process loads what it is given, so call it in every process with the same state dict.
        Under a sharded strategy whole tensors are cut into this process's shards (its own shards load as they are).
        assign=True is refused: the strategy's replicas, optimizers and gradient exchange hold the parameters set up.
        """
        if assign:
            raise ValueError(
                f"assign: True would make the given tensors the model's parameters, which strategy "
                f"'{self.strategy.name}' does not train (its optimizers, replicas and gradient exchange hold the "
                "parameters engine.setup saw); load with assign=False (a copy into them), or call "
                "load_state_dict(..., assign=True) on the bare model before engine.setup"
            )
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a dict of tensors keyed by name, got {type(state_dict).__name__}")
        if self.strategy.traits.sharded:
            state_dict = whole_tensors_as_shards(self.user_module, state_dict)
        try:
            return self.user_module.load_state_dict(state_dict, strict=strict)
        finally:
            # torch copies the keys that match before it raises for the others: the other copies follow either way
            self.strategy.weights_loaded()


def whole_tensors_as_shards(model: nn.Module, state: Mapping[str, Any]) -> Mapping[str, Any]:
    """`state` with each whole tensor given for a sharded entry of `model` (a DTensor of the same shape) replaced by
    this process's shard of it, cut locally (no collective: every process holds the whole state, as with a bare
    model). Entries that are shards already, or do not fit, are left for torch's load_state_dict to load or refuse."""
    own = model.state_dict()
    converted = OrderedDict(state)
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        converted._metadata = metadata  # type: ignore[attr-defined]  # versions that modules' loading reads
    for key, value in state.items():
        mine = own.get(key)
        if (
            isinstance(mine, DTensor)
            and isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor)
            and value.shape == mine.shape
        ):
            converted[key] = distribute_tensor(
                value.detach().to(mine.device), mine.device_mesh, mine.placements, src_data_rank=None
            )
    return converted


@dataclass
class Accumulation:
    """Where the loop is in its accumulation window, and how many optimizer steps it took.

    The Engine counts backward calls; the optimizer steps (and zeroes gradients) only at the end of a
    window of `every` of them. Both read this one object.
    """

    every: int
    micro_batches: int = 0  # backward calls in the current window
    stepped: bool = False  # an optimizer already stepped at the end of this window
    steps: int = 0  # optimizer steps taken (windows completed by a step)

    def add_micro_batch(self) -> bool:
        """Count a backward call; True when it completes the window (gradients must be exchanged)."""
        if self.micro_batches >= self.every:
            self.micro_batches, self.stepped = 0, False
        self.micro_batches += 1
        return self.micro_batches == self.every

    @property
    def complete(self) -> bool:
        return self.micro_batches >= self.every

    @property
    def at_boundary(self) -> bool:
        """Between windows: nothing accumulated that a step has not consumed."""
        return self.micro_batches == 0 or (self.complete and self.stepped)

    def count_step(self) -> None:
        if not self.stepped:
            self.stepped = True
            self.steps += 1


class EngineOptimizer:
    """The strategy's optimizer; step and zero_grad act once per `accumulate` backward calls."""

    def __init__(self, optimizer: Any, accumulation: Accumulation, precision: Precision):
        self.optimizer = optimizer
        self.accumulation = accumulation
        self.precision = precision

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.accumulation.micro_batches == 0 or self.accumulation.complete:  # not in the middle of a window
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable | None = None) -> Any:
        if self.accumulation.micro_batches == 0:
            # a plain loss.backward() bypasses the Engine's count: stepping silently never would be worse
            raise RuntimeError(
                "optimizer.step(): no engine.backward(loss) since the last step; in an Engine loop call "
                "engine.backward(loss) instead of loss.backward() (it weights, accumulates and exchanges the gradients)"
            )
        if not self.accumulation.complete:
            return None  # still accumulating micro-batches
        self.accumulation.count_step()
        if closure is not None:
            return self.optimizer.step(closure)
        return self.precision.step(self.optimizer)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:  # param_groups, state, defaults, …
        if name in ("optimizer", "accumulation", "precision"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)


class DeviceLoader:
    """Moves every tensor of every batch to the device (GPUs; a no-op wrapper is never made for CPU)."""

    def __init__(self, loader: Iterable, device: torch.device):
        self.loader, self.device = loader, device

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield map_leaves(
                lambda _, x: x.to(self.device, non_blocking=True) if isinstance(x, torch.Tensor) else x, batch, "batch"
            )

    def __len__(self) -> int:
        if not isinstance(self.loader, Sized):  # as len() itself says
            raise TypeError(f"object of type {type(self.loader).__name__!r} has no len()")
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class Engine:
    """Set up model, optimizer, criterion and loader for a strategy; backward, reduce, gather, save.

    Args:
        strategy: "single", "dp", "dp-balanced", "replicated", "ddp" or "fsdp" (see dpkit.strategies); "auto"
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
        **strategy_options: passed to the strategy, e.g. timeout_seconds= and seed= for ddp.
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
        **strategy_options: Any,
    ):
        check_int(accumulate, "accumulate", meaning="micro-batches per optimizer step")
        if nonfinite_loss not in NONFINITE_LOSS:
            raise ValueError(
                f"nonfinite_loss: expected None (no check), 'warn' or 'raise', got {nonfinite_loss!r}; 'warn' logs "
                "the first step whose loss is nan or inf, 'raise' stops there with NonFiniteLoss"
            )
        # off by default: the check reads the loss's value each step (a device sync, and a collective across
        # processes so that every process stops at the same step)
        self.nonfinite_loss = nonfinite_loss
        self._warned_nonfinite = False
        strategy, devices = self._resolve_auto(strategy, accelerator, devices)
        # strategy="auto" on several devices in one process: these devices, until the first batch decides
        self._undecided: list[torch.device] | None = None
        if strategy == UNDECIDED:  # (_resolve_auto resolved the devices: resolving them again gives the same list)
            undecided = resolve_devices(accelerator, devices)
            self._undecided, strategy, devices = undecided, reference(), undecided[:1]  # the reference until then
        most = strategy_class(strategy).traits.max_devices
        if devices == "auto" and most is not None:
            devices = most
        self.devices = resolve_devices(accelerator, devices)
        if self.devices[0].type == "cpu":
            # before any step, so every step of the process runs alike: glibc would otherwise hand each
            # freed activation and gradient back to the kernel and page-fault it in again the next step
            # (devices.keep_freed_host_memory; DPKIT_KEEP_HOST_MEMORY=0 leaves malloc alone)
            keep_freed_host_memory()
        self.precision = Precision(precision, self.devices[0].type)
        self.strategy: Strategy = create_strategy(
            strategy, self.devices, precision=self.precision.precision, **strategy_options
        )
        self._strategy_options = strategy_options
        if self.precision.scaler is not None and not self.strategy.traits.grad_scaler:
            able = ", ".join(matching(lambda traits: traits.grad_scaler))
            raise ValueError(
                f"precision: '16-mixed' is not supported with strategy '{strategy}' yet; use precision='bf16-mixed' "
                f"or one of the strategies {able}"
            )
        self.accumulate = accumulate
        self.show_progress = progress
        self._accumulation = Accumulation(accumulate)
        self._optimizers: list[EngineOptimizer] = []
        self._loaders: list[ResumableLoader] = []  # in setup order; their positions are part of the state
        self._batch_in_hand: BatchRecord | None = None  # the latest batch any of them yielded
        self._pending_loaders: list[tuple[dict, dict | None]] = []  # positions loaded before their loader was set up
        self._model: EngineModule | None = None
        self._bare_model: nn.Module | None = None  # the user's model object (replica 0 / the DDP module)
        self._given_optimizers: list[torch.optim.Optimizer] = []  # as given to setup, for a strategy decided later
        self._criteria: list[list[Callable]] = []  # [criterion, what the strategy made of it] from setup_criterion
        self.strategy.setup_environment()
        if self.is_global_zero:
            log.debug(
                "engine: strategy %s on %s, precision %s, accumulate %d",
                strategy,
                ", ".join(map(str, self.devices)),
                precision,
                accumulate,
            )

    @staticmethod
    def _resolve_auto(strategy: Any, accelerator: str, devices: Any) -> tuple[str, Any]:
        """strategy="auto", or the Choice dpkit.choose_strategy returned: the strategy's name and its devices, the
        choice said in one line (rank 0)."""
        if isinstance(strategy, Choice):
            if not launched() or os.environ.get("RANK") == "0":
                print(strategy.reason, flush=True)
            if strategy.devices == 1 and not launched():
                devices = resolve_devices(accelerator, devices)[:1]
            return strategy.strategy, devices
        if strategy != "auto":
            return strategy, devices
        if launched() and int(os.environ["WORLD_SIZE"]) > 1:  # a launcher started a process per device
            return "ddp", devices
        resolved = resolve_devices(accelerator, devices)
        if len(resolved) == 1:
            return reference(), resolved
        return UNDECIDED, resolved

    # --- where we are ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.rank == 0

    @property
    def device(self) -> torch.device:
        """Where this process's model lives and where its batches go."""
        return self.strategy.root_device

    # --- setup -------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """(model, optimizer) wrapped for the strategy; build the optimizer from model.parameters() first.

        The wrapped model's state_dict() and load_state_dict() use `model`'s own keys under every strategy."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if self._model is not None:
            raise RuntimeError("engine.setup: this engine already set up a model; create one Engine per model")
        if optimizer is not None and (not hasattr(optimizer, "step") or not hasattr(optimizer, "param_groups")):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if optimizer is not None:
            check_optimizer_of(model, optimizer)
        self._bare_model = model
        self._model = EngineModule(self.strategy.wrap_model(model), self.precision, self.strategy, model)
        if self._undecided is not None:
            self._model.__dict__["decide"] = self._decide_from_batch
        if optimizer is None:
            return self._model
        engine_optimizer = EngineOptimizer(self.strategy.wrap_optimizer(optimizer), self._accumulation, self.precision)
        self._optimizers.append(engine_optimizer)
        self._given_optimizers.append(optimizer)
        return self._model, engine_optimizer

    # --- strategy="auto" on several devices: decided by the first batch ------------------------------------------
    def _decide_from_batch(self, args: tuple, kwargs: dict) -> None:
        """The model's first call: choose the strategy from the model, this batch and the devices (one-process
        strategies only: this process drives every device), say it, and set it up in place of the reference."""
        sample = next(
            (leaf for _, leaf in leaves((args, kwargs), "inputs") if isinstance(leaf, torch.Tensor) and leaf.dim() > 0),
            None,
        )
        if sample is None:
            raise ValueError(
                "strategy: 'auto' chooses from the model's first batch, and its first call got no tensor with a batch "
                "dimension; pass the strategy by name, or strategy=dpkit.choose_strategy(model, inputs, batch_size, "
                "devices)"
            )
        precision = self.precision.precision
        candidates = matching(
            lambda traits: traits.processes != PER_DEVICE and (self.precision.scaler is None or traits.grad_scaler)
        )
        undecided, bare_model = self._undecided, self._bare_model
        if undecided is None or bare_model is None:  # (the first batch decides once, after engine.setup)
            return
        with torch.enable_grad():  # a brief measurement may train the probe models, even under no_grad
            choice = choose_strategy(
                bare_model,
                sample,
                int(sample.shape[0]),
                undecided,
                precision,
                self._given_optimizers[0] if self._given_optimizers else "sgd",
                can_launch=False,
                strategies=candidates,
            )
        print(choice.reason, flush=True)
        self._adopt(choice.strategy, undecided[: choice.devices])

    def _adopt(self, name: str, devices: list[torch.device]) -> None:
        """Set up strategy `name` on `devices` in place of the reference that ran until the decision: the model,
        the optimizers, the criteria and the loaders set up so far follow it."""
        self._undecided = None
        model, bare_model = self._model, self._bare_model
        if model is None or bare_model is None:  # (adopted from engine.setup on)
            raise RuntimeError("engine: strategy 'auto' decides after engine.setup(model, optimizer)")
        model.__dict__.pop("decide", None)
        if name == self.strategy.name and len(devices) == len(self.devices):
            return
        self.devices = devices
        self.strategy = create_strategy(name, devices, precision=self.precision.precision, **self._strategy_options)
        self.strategy.setup_environment()
        model.module = self.strategy.wrap_model(bare_model)
        model.strategy = self.strategy
        for engine_optimizer, given in zip(self._optimizers, self._given_optimizers):
            engine_optimizer.optimizer = self.strategy.wrap_optimizer(given)
        for criterion in self._criteria:
            criterion[1] = self.strategy.wrap_criterion(criterion[0])
        for loader in self._loaders:
            loader.rule = self.strategy  # one-process strategies share the data rule: only the loss weight is read

    def _decide_from_state(self, saved: Any, where: Path) -> None:
        """engine.load_state before the first batch under strategy="auto": resume with the strategy the state was
        saved under when this process can run it; otherwise the first batch still decides."""
        if saved not in matching(lambda traits: traits.processes != PER_DEVICE) or (
            self.precision.scaler is not None and not strategy_class(saved).traits.grad_scaler
        ):
            return
        most = strategy_class(saved).traits.max_devices
        undecided = self._undecided
        if undecided is None:  # (called while undecided)
            return
        devices = undecided[: most or len(undecided)]
        print(
            f"auto: {saved} on {len(devices)} device(s), the strategy the state in {where} was saved under", flush=True
        )
        self._adopt(saved, devices)

    def setup_criterion(self, criterion: Callable) -> Callable:
        """The criterion to call as criterion(model(x), y); under dp-balanced and replicated it runs the
        forward and the loss inside the replicas. Elsewhere it is `criterion`, announced as the "loss" phase."""
        if not callable(criterion):
            raise TypeError(
                f"criterion: expected a callable loss such as nn.CrossEntropyLoss(), got {type(criterion).__name__}"
            )
        if self._model is None:
            raise RuntimeError("engine.setup_criterion: call engine.setup(model, optimizer) first")
        in_replicas = [criterion, self.strategy.wrap_criterion(criterion)]  # wrapped anew if "auto" decides later
        self._criteria.append(in_replicas)
        precision, device = self.precision, self.device

        def engine_criterion(output: Any, *targets: Any, **kwargs: Any) -> torch.Tensor:
            if isinstance(output, DeferredOutput):  # the replicas announce their own loss phases
                with precision.autocast():
                    return in_replicas[1](output, *targets, **kwargs)
            with hooks.phase("loss", device):
                return criterion(output, *targets, **kwargs)

        return engine_criterion

    def setup_dataloader(self, loader: Iterable) -> Iterable:
        """The loader to iterate: its batches are global; under ddp each process gets its share.

        A torch DataLoader over a map-style dataset comes back as a loader whose position (epoch, next
        batch) is part of engine.save_state; other iterables come back unchanged and are not tracked.
        """
        if resumable(loader):
            loader = ResumableLoader(loader, self.strategy, on_batch=self._batch_yielded)
        elif self.strategy.traits.processes == PER_DEVICE:
            raise TypeError(
                f"loader: strategy '{self.strategy.name}' gives each process its share of every global batch, "
                "which needs a "
                "torch DataLoader over a map-style dataset with batch_size= or batch_sampler=, got "
                f"{type(loader).__name__}{' over an IterableDataset' if isinstance(loader, DataLoader) else ''}"
            )
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
    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() for the strategy: sample-weighted, accumulated, reduced across devices."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss: expected a tensor, got {type(loss).__name__}")
        if self.nonfinite_loss is not None:
            self._check_loss(loss)
        sync = self._accumulation.add_micro_batch()
        self.strategy.backward(self.precision.scale_loss(loss), scale=self._loss_weight() / self.accumulate, sync=sync)

    def _check_loss(self, loss: torch.Tensor) -> None:
        """nonfinite_loss: warn about, or stop at, a loss that is nan or inf in any process (all agree)."""
        value = float(loss.detach().float().sum())
        bad = torch.tensor(0.0 if math.isfinite(value) else 1.0)
        if self.world_size > 1:
            bad = self.strategy.all_reduce(bad, "sum")
        if not bad:
            return
        what = f"{value:g}" if not math.isfinite(value) else "nan or inf in another process"
        window = self._accumulation.micro_batches % self.accumulate + 1  # this backward's place in its window
        message = (
            f"engine.backward: the loss is {what} at step {self.step + 1}"
            + (f" (micro-batch {window} of {self.accumulate})" if self.accumulate > 1 else "")
            + "; the step would make every weight it touches nan: lower the learning rate, clip the gradients "
            "(engine.clip_gradients) or look at the batch"
        )
        if self.nonfinite_loss == "raise":
            raise NonFiniteLoss(message)
        if not self._warned_nonfinite:
            self._warned_nonfinite = True  # said once: a run that diverged stays diverged
            log.warning("%s", message)

    def _batch_yielded(self, record: BatchRecord) -> None:
        self._batch_in_hand = record

    def _loss_weight(self) -> float:
        """The loss weight of the batch in hand (the strategy's loss_weight for its rows, recorded by the loader
        that yielded it; 1 without an Engine loader)."""
        return self._batch_in_hand.loss_weight if self._batch_in_hand is not None else 1.0

    @property
    def step(self) -> int:
        """Optimizer steps taken through the Engine's optimizer (restored by load_state)."""
        return self._accumulation.steps

    # --- metrics across processes ------------------------------------------------------------------
    def clip_gradients(self, optimizer: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ for the gradients the next `optimizer.step()` applies, under every strategy
        and precision (16-mixed unscales first; replicas that step themselves are clipped alike; a sharded model's
        norm is the whole model's). Call it after the last micro-batch's backward; returns the norm before
        clipping, the same on every device and process."""
        check_number(max_norm, "max_norm", positive=True)
        if self._model is None or not isinstance(optimizer, EngineOptimizer):
            raise RuntimeError("engine.clip_gradients: pass the optimizer engine.setup(model, optimizer) returned")
        unscaled = self.precision.unscale(optimizer.optimizer)
        first, *others = self.strategy.gradient_holders(self._model)
        norm = torch.nn.utils.clip_grad_norm_(first, max_norm, norm_type=norm_type)
        if others:
            factor = unscaled * min(1.0, max_norm / (float(norm) + 1e-6))
            with torch.no_grad():
                for params in others:
                    for param in params:
                        if param.grad is not None:
                            param.grad.mul_(factor)
        return norm

    def reduce(self, value: Any, op: str = "mean", *, weight: float | None = None) -> torch.Tensor:
        """`value` combined over processes: "sum", "mean", or with weight= the weight-averaged mean
        (e.g. a per-process mean loss with weight=len(y) gives the mean over all samples)."""
        if op not in ("mean", "sum"):
            raise ValueError(f"op: expected 'mean' or 'sum', got {op!r}")
        tensor = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value, dtype=torch.float64)
        if weight is not None:
            if op != "mean":
                raise ValueError("weight: only op='mean' takes a weight")
            weights = self.strategy.all_reduce(torch.as_tensor(float(weight), dtype=torch.float64), "sum")
            return self.strategy.all_reduce(tensor * float(weight), "sum") / weights
        return self.strategy.all_reduce(tensor, op)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rows from every process in global-batch order; with engine.setup_dataloader each sample once."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            raise TypeError("tensor: expected a tensor with a batch dimension (rows) to gather")
        return self.strategy.all_gather_rows(tensor)

    def barrier(self) -> None:
        self.strategy.barrier()

    def gather_object(self, obj: Any) -> list[Any]:
        """Every process's `obj` (picklable, e.g. an observe.Report), in rank order; [obj] in one process."""
        return self.strategy.all_gather_object(obj)

    def model_copies(self) -> list[tuple[nn.Module, torch.device]]:
        """(module, device) for every copy of the model this process keeps between steps: a strategy's
        persistent replicas where it has them (replicated), else the set-up model on this process's device."""
        if self._bare_model is None:
            raise RuntimeError("engine.model_copies: call engine.setup(model, optimizer) first")
        return self.strategy.model_copies(self._bare_model)

    # --- rank-0 output -----------------------------------------------------------------------------
    def progress(self, iterable: Iterable | None = None, **tqdm_kwargs: Any) -> tqdm:
        """A tqdm bar, shown on rank 0 only (and only with progress=True)."""
        disable = not (self.show_progress and self.is_global_zero) or tqdm_kwargs.pop("disable", False)
        return tqdm(iterable, disable=disable, **tqdm_kwargs)

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_global_zero:
            print(*args, **kwargs)

    def save(self, model: nn.Module, path: str | os.PathLike) -> None:
        """Rank 0 writes the clean state dict (as dpkit.save_model); every process calls it and waits for it."""
        with busy("saving the model"):  # rank 0 writes while the others wait: progress, not a hang
            self._save(model, path)

    def _save(self, model: nn.Module, path: str | os.PathLike) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        state = self.strategy.model_state(unwrap_model(model))
        if self.is_global_zero and state is not None:  # (rank 0 holds the state)
            save_state_dict(state, path)
        self.barrier()

    def load(self, path: str | os.PathLike) -> nn.Module:
        """Load a checkpoint (clean or prefixed) into the set-up model, in every process and every replica."""
        with busy("loading the model"):
            return self._load(path)

    def _load(self, path: str | os.PathLike) -> nn.Module:
        if self._bare_model is None or self._model is None:
            raise RuntimeError("engine.load: call engine.setup(model, optimizer) first")
        bare = unwrap_model(self._bare_model)
        state = read_model_file(path, map_location="cpu" if self.device.type == "cpu" else self.device)
        self.strategy.load_model_state(bare, check_state_dict(bare, state, path))
        return self._model

    # --- resumable training state ------------------------------------------------------------------------
    def save_state(self, directory: str | os.PathLike, *, keep: int | None = 3, **extra: Any) -> Path:
        """Save everything a resumed run needs into `directory`/step-NNNNNNNN, and point `directory`/latest at it.

        Holds the model (clean keys), the optimizers, the GradScaler, engine.step, the position of every
        loader from engine.setup_dataloader, every process's generator states, and `extra` (plain values,
        tensors, or objects with state_dict(), such as an LR scheduler). Keeps the newest `keep` states.
        Every process must call it (under ddp it is a collective); call it between optimizer steps.
        Returns the step directory written.
        """
        with busy("saving the training state"):  # a slow save is progress, not a hang (dpkit.launch.busy)
            return self._save_state(directory, keep=keep, **extra)

    def _save_state(self, directory: str | os.PathLike, *, keep: int | None = 3, **extra: Any) -> Path:
        keep = check_keep(keep)
        if self._model is None or self._bare_model is None:
            raise RuntimeError("engine.save_state: call engine.setup(model, optimizer) first")
        if self._optimizers and not self._accumulation.at_boundary:  # without the Engine's optimizer no window is known
            raise RuntimeError(
                f"engine.save_state: called after micro-batch {self._accumulation.micro_batches} "
                f"of {self.accumulate} of an "
                "accumulation window, before its optimizer.step(); call it after optimizer.step()"
            )
        directory = Path(directory)
        bare = unwrap_model(self._bare_model)
        optimizers = [optimizer.optimizer for optimizer in self._optimizers]
        # every process takes part: a sharded strategy's processes each write their shards (DCP); another
        # strategy whose state is spread over the processes gathers it to rank 0 here
        # an optimizer that has not stepped has no state to shard (asking for it would make torch initialize
        # it, changing its next step): it is saved as fresh, and a load leaves it fresh
        stepped = {str(index): optimizer for index, optimizer in enumerate(optimizers) if optimizer.state}
        shards = self.strategy.sharded_state(bare, stepped)
        model_state, optimizer_states = None, None
        if shards is None:
            model_state = self.strategy.model_state(bare)
            optimizer_states = [self.strategy.optimizer_state(optimizer) for optimizer in optimizers]
        shared = None
        if self.is_global_zero:
            shared = {
                "format": STATE_FORMAT,
                "step": self.step,
                "strategy": self.strategy.name,
                "world_size": self.world_size,
                "devices": [str(d) for d in self.devices],
                "precision": self.precision.precision,
                "accumulate": self.accumulate,
                "model": None if model_state is None else detached_on_cpu(strip_prefixes(model_state)),
                "optimizers": optimizer_states,
                # with shards: the optimizers' param group sizes, checked before a load reads any shard
                "optimizer_groups": [[len(group["params"]) for group in opt.param_groups] for opt in optimizers],
                "optimizers_in_shards": sorted(stepped) if shards is not None else None,
                # each optimizer's class: a load refuses another class's state (Adam's moments into SGD)
                "optimizer_classes": [kind_of(getattr(opt, "user", opt)) for opt in optimizers],
                "scaler": self.precision.scaler.state_dict() if self.precision.scaler is not None else None,
                "loaders": [loader.position() for loader in self._loaders],
                # what a strategy learned that decides its arithmetic (dp-balanced: its chunk sizes)
                "strategy_state": self.strategy.state_dict() or None,
                "extra": pack_extras(extra),
            }
        mine = {
            "rank": self.rank,
            "rng": capture_rng(),
            "loaders": [loader.order_state() for loader in self._loaders],
            # intra-op threads split a large reduction (a matrix product's inner sum, a norm) into per-thread
            # partial sums, so their count decides the result's last bits: a resume computes with the same count
            "threads": torch.get_num_threads(),
        }
        # all or nothing in every process: a failure anywhere (a full disk) raises everywhere and leaves the
        # previous states and `latest` as they were
        written = write_state_directory(
            directory,
            self.step,
            shared,
            mine,
            rank=self.rank,
            keep=keep,
            barrier=self.barrier,
            shards=shards,
            gather=self.strategy.all_gather_object,
        )
        if self.is_global_zero:
            log.info("saved the training state at step %d to %s", self.step, written)
        return written

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
        with busy("loading the training state"):
            return self._load_state(directory, **objects)

    def _load_state(self, directory: str | os.PathLike, **objects: Any) -> dict[str, Any]:
        if self._model is None or self._bare_model is None:
            raise RuntimeError("engine.load_state: call engine.setup(model, optimizer) first")
        # read onto the CPU: load_state_dict moves weights and optimizer state to their parameters' devices
        chosen, shared, mine = read_state_directory(directory, self.rank, map_location="cpu")
        if self._undecided is not None:
            self._decide_from_state(shared.get("strategy"), chosen)
        source = chosen / "state.pt"
        bare = unwrap_model(self._bare_model)
        optimizers = [optimizer.optimizer for optimizer in self._optimizers]
        # --- check everything first ---
        shards = chosen / shared["shards"] if shared.get("shards") else None
        sharded_load = False  # this strategy reads its own shards of a sharded state (DCP reshards them)
        model_state: dict[str, Any] | None  # None: the shards load into the model
        saved_optimizers: list[dict[str, Any]]
        if shards is not None:
            self._verify_shards(shards, shared.get("shard_digests") or {})
            sharded_load = self.strategy.traits.sharded
            if sharded_load:
                check_shard_shapes(bare, shards)
                model_state, saved_optimizers = None, [{"param_groups": []}] * len(shared["optimizer_groups"])
            else:  # a whole state in this process: the shards joined (any strategy resumes a sharded run)
                whole = read_whole(shards)
                model_state = check_state_dict(bare, whole.get("model", {}), shards)
                in_shards = whole.get("optimizers", {})
                saved_optimizers = [
                    numbered_optimizer_state(in_shards[str(index)])
                    if str(index) in in_shards
                    else {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}  # saved fresh
                    for index, optimizer in enumerate(optimizers[: len(shared["optimizer_groups"])])
                ]
        else:
            model_state = check_state_dict(bare, shared.get("model", {}), source)
            saved_optimizers = shared.get("optimizers", [])
        if len(saved_optimizers) != len(self._optimizers):
            raise ValueError(
                f"optimizer: the state holds {len(saved_optimizers)} optimizer(s), "
                f"this engine set up {len(self._optimizers)}; "
                "set up the same model and optimizer(s) before engine.load_state"
            )
        saved_classes = list(shared.get("optimizer_classes") or [])  # absent from states saved before it was recorded
        for index, (optimizer, saved) in enumerate(zip(self._optimizers, saved_optimizers)):
            groups = [len(group["params"]) for group in optimizer.param_groups]
            saved_groups = (
                [len(group.get("params", ())) for group in saved.get("param_groups", [])]
                if isinstance(saved, dict)
                else None
            )
            if sharded_load:
                saved_groups = list(shared["optimizer_groups"][index])
            check_optimizer_class(
                index, optimizer.optimizer, saved_classes[index] if index < len(saved_classes) else None
            )
            if groups != saved_groups:
                raise ValueError(
                    f"optimizer {index}: the state has param groups of sizes {saved_groups}, this optimizer {groups}; "
                    "build the optimizer as in the saved run"
                )
            if not sharded_load:
                check_optimizer_state(index, optimizer.optimizer, saved)
        positions = shared.get("loaders", [])
        order_states = mine.get("loaders", [])
        for index, (loader, position) in enumerate(zip(self._loaders, positions)):
            loader.check_position(position, f"{source}: loaders[{index}]")
            if position["next_batch"] > 0 and (index >= len(order_states) or order_states[index] is None):
                raise CheckpointCorruptError(
                    f"{source}: loaders[{index}] stopped mid-epoch, "
                    "but the state holds no generator states for that epoch's order"
                )
        check_rng(mine.get("rng"), chosen)
        if not isinstance(shared.get("step"), int) or isinstance(shared["step"], bool) or shared["step"] < 0:
            raise CheckpointCorruptError(f"{source}: its step ({shared.get('step')!r}) is not a step count")
        extras = shared.get("extra", {})
        for name, target in objects.items():
            check_named_object(name, target, extras, source)
        if shared.get("world_size") != self.world_size or shared.get("strategy") != self.strategy.name:
            log.info(
                "resuming a state saved by strategy %s on %s process(es) under strategy %s on %d",
                shared.get("strategy"),
                shared.get("world_size"),
                self.strategy.name,
                self.world_size,
            )
        # --- then change everything: the steps a load_state_dict could still refuse first, each undone on a
        # failure; the model last (its keys, shapes and types are checked); the step, loaders and generators,
        # which cannot fail, once everything else is in
        undo = _Undo()
        try:
            for name, target in objects.items():
                undo.keep(name, target, copy.deepcopy(target.state_dict()))
                saved = extras[name]["value"]
                if isinstance(target, nn.Module):  # keyed as it names them: saved through a wrapper, or bare, loads
                    saved = check_state_dict(target, saved, source)
                target.load_state_dict(saved)
            if self.precision.scaler is not None and shared.get("scaler"):
                undo.keep("the GradScaler", self.precision.scaler, self.precision.scaler.state_dict())
                self.precision.scaler.load_state_dict(shared["scaler"])
            strategy_state = shared.get("strategy_state")
            if (
                strategy_state
                and shared.get("strategy") == self.strategy.name
                and shared.get("world_size") == self.world_size
            ):
                undo.keep(f"strategy {self.strategy.name}", self.strategy, copy.deepcopy(self.strategy.state_dict()))
                self.strategy.load_state_dict(strategy_state)
            if sharded_load and shards is not None:  # (sharded_load: there are shards)
                undo.step = "the sharded model and optimizers"
                self._load_shards(bare, optimizers, shared["optimizers_in_shards"], shards)
            else:
                for index, (optimizer, saved) in enumerate(zip(optimizers, saved_optimizers)):
                    undo.keep(f"optimizer {index}", optimizer, optimizer_snapshot(optimizer))
                    self.strategy.load_optimizer_state(optimizer, saved)
                undo.step = "the model"
                if model_state is not None:  # (read whole unless the shards load themselves)
                    self.strategy.load_model_state(bare, model_state)
        except Exception as error:
            raise undo.back(error, chosen) from error
        self._accumulation.steps, self._accumulation.micro_batches, self._accumulation.stepped = (
            int(shared["step"]),
            0,
            False,
        )
        padded = list(order_states) + [None] * (len(positions) - len(order_states))
        self._pending_loaders = list(zip(positions, padded))
        for loader, (position, order_state) in zip(self._loaders, self._pending_loaders):
            loader.resume_from(position, order_state)
        restore_rng(mine["rng"])
        threads = mine.get("threads")
        if (
            self.device.type == "cpu"
            and isinstance(threads, int)
            and threads > 0
            and threads != torch.get_num_threads()
        ):
            log.info(
                "%s: computing with its %d intra-op threads (this process had %d)",
                chosen,
                threads,
                torch.get_num_threads(),
            )
            torch.set_num_threads(threads)
        log.info("resumed from %s at step %d", chosen, self.step)
        return {name: entry["value"] for name, entry in extras.items()}

    def _verify_shards(self, folder: Path, digests: dict[str, str]) -> None:
        """Every shard file's checksum, each process checking its part; all raise if any part is damaged."""
        names = sorted(digests)
        mine = {name: digests[name] for name in names[self.rank :: self.world_size]}
        try:
            verify_shards(folder, mine, every=names)
            problem = None
        except CheckpointCorruptError as error:
            problem = str(error)
        found = next((p for p in self.strategy.all_gather_object(problem) if p), None)
        if found:
            raise CheckpointCorruptError(found)

    def _load_shards(self, bare: nn.Module, optimizers: list[Any], in_shards: list[str], folder: Path) -> None:
        """Read this process's shards into copies, then apply them: a load that fails leaves the model as it was,
        and the optimizers too (asking a fresh optimizer for its sharded state initializes it; undone here).
        An optimizer saved before its first step is left fresh."""
        before = [optimizer.state_dict() for optimizer in optimizers]
        saved = {name: optimizers[int(name)] for name in in_shards}
        try:
            state = self.strategy.sharded_state(bare, saved)
            if state is None:  # (only a sharded strategy loads shards)
                raise RuntimeError(f"strategy {self.strategy.name!r} keeps no sharded state to load shards into")
            filled = load_into(state, folder)
        except Exception:
            for optimizer, state in zip(optimizers, before):
                optimizer.load_state_dict(state)
            raise
        self.strategy.load_sharded_state(bare, saved, filled)
        for index, optimizer in enumerate(optimizers):
            if str(index) not in saved:
                optimizer.load_state_dict({"state": {}, "param_groups": optimizer.state_dict()["param_groups"]})

    def close(self) -> None:
        """Release the strategy's resources (the process group under ddp)."""
        self.strategy.teardown()


# --- loading a state: the checks made before anything changes, and the undo of what changed --------------


def check_optimizer_class(index: int, optimizer: Any, saved_class: str | None) -> None:
    """Refuse the state of another optimizer class (Adam's moments into SGD) before anything changes."""
    here = kind_of(getattr(optimizer, "user", optimizer))
    if saved_class is not None and same_kind(saved_class, here) is False:
        raise CheckpointMismatchError(
            f"optimizer {index}: the state was saved from {short_kind(saved_class)}, this engine set up "
            f"{short_kind(here)}; build the optimizer as in the saved run. Nothing was loaded"
        )


def check_optimizer_state(index: int, optimizer: Any, saved: dict[str, Any]) -> None:
    """Refuse per-parameter state that does not fit the optimizer's parameters, before anything changes: an
    entry for a parameter it does not have, or (for an elementwise optimizer such as SGD or Adam) a state
    tensor of another shape than its parameter."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    state = saved.get("state", {})
    if not isinstance(state, Mapping):
        raise CheckpointCorruptError(f"optimizer {index}: its saved state is a {type(state).__name__}, not a dict")
    elementwise = isinstance(getattr(optimizer, "user", optimizer), ELEMENTWISE)
    wrong = []
    for key, entry in state.items():
        if not isinstance(key, int) or not 0 <= key < len(params) or not isinstance(entry, Mapping):
            wrong.append(f"an entry {key!r} for none of its {len(params)} parameters")
            continue
        shape = tuple(params[key].shape)
        for name, value in entry.items():
            if (
                elementwise
                and isinstance(value, torch.Tensor)
                and value.dim() > 0
                and value.numel() > 1
                and tuple(value.shape) != shape
            ):
                wrong.append(f"parameter {key}'s {name}: state {tuple(value.shape)} vs parameter {shape}")
    if wrong:
        shown = "; ".join(wrong[:8]) + (f"; and {len(wrong) - 8} more" if len(wrong) > 8 else "")
        raise CheckpointMismatchError(
            f"optimizer {index}: its saved state does not fit this optimizer's parameters ({shown}); build the "
            "model and optimizer as in the saved run. Nothing was loaded"
        )


def check_named_object(name: str, target: Any, extras: Mapping[str, Any], source: Any) -> None:
    """Refuse an object passed to load_state by name that the state does not hold, or holds for another kind
    of object (a StepLR's state given to a CosineAnnealingLR), before anything changes."""
    if name not in extras:
        raise CheckpointMismatchError(
            f"{name}: not in the saved state's extras ({', '.join(sorted(extras)) or 'none'}); pass by name only the "
            f"objects saved with engine.save_state(..., {name}=...). Nothing was loaded"
        )
    entry = extras[name]
    if entry.get("kind") != "state_dict" or not callable(getattr(target, "load_state_dict", None)):
        raise TypeError(
            f"{name}: saved as a plain value; it comes back in load_state's result, not through load_state_dict"
        )
    saved_class, here = entry.get("class"), kind_of(target)
    if saved_class is not None and same_kind(saved_class, here) is False:
        raise CheckpointMismatchError(
            f"{name}: the state was saved from {short_kind(saved_class)}, given {short_kind(here)}; pass the same "
            "kind of object as in the saved run. Nothing was loaded"
        )
    if isinstance(target, nn.Module):
        check_state_dict(target, entry["value"], f"{name} (saved in {source})")


def optimizer_snapshot(optimizer: Any) -> dict[str, Any]:
    """A copy of the optimizer's state dict to put back with load_state_dict: plain tensors copied to the CPU
    (load_state_dict moves them to their parameters' devices), so that a copy costs no device memory."""

    def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
        if type(tensor) is torch.Tensor:
            return tensor.detach().to("cpu", copy=True)
        return tensor.detach().clone()  # a DTensor: its local shard, where it is

    return tree_map_only(torch.Tensor, copy_tensor, optimizer.state_dict())


class _Undo:
    """What load_state changed so far, each with its state from before, put back when a later step fails."""

    def __init__(self) -> None:
        self.changed: list[tuple[str, Any, Any]] = []
        self.step = "the state"  # what is being loaded now, for the message

    def keep(self, what: str, target: Any, before: Any) -> None:
        self.changed.append((what, target, before))
        self.step = what

    def back(self, error: Exception, chosen: Path) -> Exception:
        """Put everything back; the error to raise (the same one unless it is a refusal of the saved state)."""
        not_back = []
        for what, target, before in reversed(self.changed):
            try:
                target.load_state_dict(before)
            except Exception as undo_error:  # noqa: BLE001 - say it, and go on putting back the others
                not_back.append(f"{what} ({undo_error})")
        partly = self.step in ("the model", "the sharded model and optimizers")
        if not_back or partly:
            held = ", ".join(not_back) if not_back else self.step
            log.error("engine.load_state: %s may now hold part of the saved state from %s", held, chosen)
        if isinstance(error, torch.cuda.OutOfMemoryError) or not isinstance(
            error, (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError)
        ):
            return error
        if partly or not_back:
            outcome = f"{', '.join(not_back) if not_back else self.step} may hold part of it"
        else:
            outcome = (
                "nothing was loaded: the model, optimizers, objects, engine.step, loaders and generators are as "
                "they were"
            )
        return CheckpointMismatchError(
            f"{self.step}: loading its saved state from {chosen} failed ({type(error).__name__}: {error}); "
            f"{outcome}. Pass the same kind of object, built as in the saved run"
        )
