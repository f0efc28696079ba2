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
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from tqdm import tqdm

from dpkit.checkpoint import load_model, save_model
from dpkit.devices import DeviceLike, resolve_devices
from dpkit.parallel import hooks
from dpkit.parallel.nested import map_leaves
from dpkit.precision import Precision
from dpkit.strategies import DeferredOutput, Strategy, create_strategy

log = logging.getLogger("dpkit")


class EngineModule(nn.Module):
    """The strategy's model, run under the precision's autocast. state_dict keys carry wrapper prefixes,
    which dpkit.save_model strips."""

    wraps_module = True  # dpkit.unwrap_model / save_model / load_model look inside

    def __init__(self, module: nn.Module, precision: Precision, strategy: Strategy):
        super().__init__()
        self.module = module
        self.precision = precision
        self.strategy = strategy

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # the strategy announces its forward through the observation seam (dpkit.parallel.hooks)
        with self.precision.autocast(), self.strategy.forward_context(args, kwargs):
            return self.module(*args, **kwargs)


class EngineOptimizer:
    """The strategy's optimizer; step and zero_grad act once per `accumulate` backward calls."""

    def __init__(self, optimizer: Any, engine: "Engine"):
        self.optimizer = optimizer
        self.engine = engine

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.engine._micro_batches == 0:  # not in the middle of an accumulation
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable | None = None) -> Any:
        if self.engine._micro_batches < self.engine.accumulate:
            return None  # still accumulating micro-batches
        self.engine._micro_batches = 0
        if closure is not None:
            return self.optimizer.step(closure)
        return self.engine.precision.step(self.optimizer)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:  # param_groups, state, defaults, …
        return getattr(self.optimizer, name)


class DeviceLoader:
    """Moves every tensor of every batch to the device (GPUs; a no-op wrapper is never made for CPU)."""

    def __init__(self, loader: Iterable, device: torch.device):
        self.loader, self.device = loader, device

    def __iter__(self):
        for batch in self.loader:
            yield map_leaves(lambda _, x: x.to(self.device, non_blocking=True) if isinstance(x, torch.Tensor) else x, batch, "batch")

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class Engine:
    """Set up model, optimizer, criterion and loader for a strategy; backward, reduce, gather, save.

    Args:
        strategy: "single", "dp", "dp-balanced", "replicated" or "ddp" (see dpkit.strategies).
        accelerator: "cpu" (virtual CPU devices), "cuda" or "auto".
        devices: a count, a list ("cpu:0", 1, …) or "auto" (1 for single; all GPUs, else 2 CPU devices).
            Under ddp it is the number of processes per node, one device each.
        precision: "32", "bf16-mixed" or "16-mixed" (CUDA only).
        accumulate: micro-batches per optimizer step.
        progress: show tqdm bars from engine.progress (on rank 0 only).
        **strategy_options: passed to the strategy, e.g. timeout_seconds= and seed= for ddp.
    """

    def __init__(self, strategy: str = "single", accelerator: str = "auto",
                 devices: int | str | Sequence[DeviceLike] = "auto", precision: str = "32", accumulate: int = 1,
                 progress: bool = True, **strategy_options: Any):
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate: expected a positive int number of micro-batches per step, got {accumulate!r}")
        if devices == "auto" and strategy == "single":
            devices = 1
        self.devices = resolve_devices(accelerator, devices)
        self.strategy: Strategy = create_strategy(strategy, self.devices, **strategy_options)
        self.precision = Precision(precision, self.devices[0].type)
        if self.precision.scaler is not None and not self.strategy.supports_grad_scaler:
            raise ValueError(f"precision: '16-mixed' is not supported with strategy '{strategy}' yet; use precision='bf16-mixed' or strategy='ddp'")
        self.accumulate = accumulate
        self.show_progress = progress
        self._micro_batches = 0
        self._model: EngineModule | None = None
        self._bare_model: nn.Module | None = None  # the user's model object (replica 0 / the DDP module)
        self.strategy.setup_environment()
        if self.is_global_zero:
            log.debug("engine: strategy %s on %s, precision %s, accumulate %d", strategy, ", ".join(map(str, self.devices)), precision, accumulate)

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
        """(model, optimizer) wrapped for the strategy; build the optimizer from model.parameters() first."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if self._model is not None:
            raise RuntimeError("engine.setup: this engine already set up a model; create one Engine per model")
        self._bare_model = model
        self._model = EngineModule(self.strategy.wrap_model(model), self.precision, self.strategy)
        if optimizer is None:
            return self._model
        if not hasattr(optimizer, "step") or not hasattr(optimizer, "param_groups"):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        return self._model, EngineOptimizer(self.strategy.wrap_optimizer(optimizer), self)

    def setup_criterion(self, criterion: Callable) -> Callable:
        """The criterion to call as criterion(model(x), y); under dp-balanced and replicated it runs the
        forward and the loss inside the replicas. Elsewhere it is `criterion`, announced as the "loss" phase."""
        if not callable(criterion):
            raise TypeError(f"criterion: expected a callable loss such as nn.CrossEntropyLoss(), got {type(criterion).__name__}")
        if self._model is None:
            raise RuntimeError("engine.setup_criterion: call engine.setup(model, optimizer) first")
        in_replicas = self.strategy.wrap_criterion(criterion)
        precision, device = self.precision, self.device

        def engine_criterion(output: Any, *targets: Any, **kwargs: Any) -> torch.Tensor:
            if isinstance(output, DeferredOutput):  # the replicas announce their own loss phases
                with precision.autocast():
                    return in_replicas(output, *targets, **kwargs)
            with hooks.phase("loss", device):
                return criterion(output, *targets, **kwargs)

        return engine_criterion

    def setup_dataloader(self, loader: Iterable) -> Iterable:
        """The loader to iterate: its batches are global; under ddp each process gets its share."""
        loader = self.strategy.wrap_dataloader(loader)
        if self.device.type != "cpu":
            loader = DeviceLoader(loader, self.device)
        return loader

    # --- the step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() for the strategy: sample-weighted, accumulated, reduced across devices."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss: expected a tensor, got {type(loss).__name__}")
        self._micro_batches += 1
        sync = self._micro_batches >= self.accumulate
        self.strategy.backward(self.precision.scale_loss(loss), scale=1.0 / self.accumulate, sync=sync)

    # --- metrics across processes ------------------------------------------------------------------
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
        replicas = getattr(self.strategy, "replicas", None) or [self._bare_model]
        return list(zip(replicas, self.strategy.devices if len(replicas) > 1 else [self.device]))

    # --- rank-0 output -----------------------------------------------------------------------------
    def progress(self, iterable: Iterable | None = None, **tqdm_kwargs: Any) -> tqdm:
        """A tqdm bar, shown on rank 0 only (and only with progress=True)."""
        disable = not (self.show_progress and self.is_global_zero) or tqdm_kwargs.pop("disable", False)
        return tqdm(iterable, disable=disable, **tqdm_kwargs)

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_global_zero:
            print(*args, **kwargs)

    def save(self, model: nn.Module, path: str | os.PathLike) -> None:
        """Rank 0 writes the clean state dict (dpkit.save_model); every process waits for it."""
        if self.is_global_zero:
            save_model(model, path)
        self.barrier()

    def load(self, path: str | os.PathLike) -> nn.Module:
        """Load a checkpoint (clean or prefixed) into the set-up model, in every process and every replica."""
        if self._bare_model is None:
            raise RuntimeError("engine.load: call engine.setup(model, optimizer) first")
        load_model(self._bare_model, path, map_location="cpu" if self.device.type == "cpu" else self.device)
        self.strategy.weights_loaded()
        return self._model

    def close(self) -> None:
        """Release the strategy's resources (the process group under ddp)."""
        self.strategy.teardown()
