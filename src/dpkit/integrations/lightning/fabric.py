"""dpkit's one-process data parallelism as a strategy for Lightning Fabric.

    fabric = lightning.fabric.Fabric(strategy=FabricDataParallelStrategy("dp", devices=["cpu:0", "cpu:1"]))
    model, optimizer = fabric.setup(model, optimizer)

It subclasses Fabric's own DataParallelStrategy, so Fabric runs it without `fabric.launch()` and gives it no
distributed sampler (every batch is the global batch). `fabric.setup` wraps the model in dpkit's replicas
(replicas.py):

- `model(x)` runs the forward in the replicas and gathers the outputs on the first device (dp's semantics);
- `model.training_step(batch, i)` (and the other step methods) of a LightningModule runs in the replicas and
  returns one device's result; its `self.log` calls are logged once, combined;
- with `criterion = fabric.strategy.setup_criterion(criterion)`, `criterion(model(x), y)` computes the loss
  inside each replica (the way dp-balanced and replicated are meant to run): only a scalar per replica
  reaches the first device, and under `replicated` each replica's backward runs in its own thread;
- `fabric.backward(loss)` gives one device's gradients; under `replicated` the replicas' gradients are
  summed and `optimizer.step()` steps the replicas' optimizer; `fabric.no_backward_sync(model)` skips the
  sum while accumulating;
- `fabric.save` / `fabric.load` see the bare module's state dict (clean keys); a loaded one reaches the replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch
from lightning.fabric.strategies import DataParallelStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _PATH, Optimizable
from torch import nn

from dpkit.devices import DeviceLike
from dpkit.integrations.lightning.arguments import check_devices, check_mode, check_options, resolve_devices
from dpkit.integrations.lightning.fabric_forward import DeferredForward
from dpkit.integrations.lightning.replicas import StepReplicas
from dpkit.integrations.lightning.trainer import check_precision, register_names

T = TypeVar("T")


class _ReplicaGradientSync(_BackwardSyncControl):
    """fabric.no_backward_sync(model): under `replicated`, backwards inside skip the gradient sum (the
    replicas keep their own gradients until a backward outside sums them all); per-step replicas have no sum."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not isinstance(module, StepReplicas) or not enabled:
            return contextlib.nullcontext()
        return module.no_sum()


class FabricDataParallelStrategy(DataParallelStrategy):
    """Lightning Fabric strategy: the model in dpkit replicas, one process.

    Args:
        mode: "dp", "dp-balanced" or "replicated" (see dpkit.lightning.DataParallelStrategy).
        devices: ["cpu:0", "cpu:1"] (virtual CPU devices), [0, 1] or ["cuda:0", "cuda:1"] (GPUs), a count
            (devices of Fabric's accelerator), or None (Fabric's devices=, on CPU as virtual devices).
        **options: the dpkit strategy's options (replicated: threads_per_device, overlap_reduce, share_weights).
    """

    def __init__(self, mode: str = "dp", devices: Sequence[DeviceLike] | int | None = None, **options: Any):
        self.mode = check_mode(mode)
        self.options = check_options(self.mode, options)
        self._asked = check_devices(devices)
        self._devices: list[torch.device] = resolve_devices(self._asked, None)
        super().__init__(parallel_devices=None)
        self._backward_sync_control = _ReplicaGradientSync()
        self._wrappers: list[StepReplicas] = []
        self._defers = False  # setup_criterion was called

    @property
    def parallel_devices(self) -> list[torch.device]:
        return list(self._devices)

    @parallel_devices.setter
    def parallel_devices(self, devices: Sequence[torch.device | str | int] | None) -> None:
        self._devices = resolve_devices(self._asked, devices)

    def _configure_launcher(self) -> None:
        check_precision(self.precision, self.mode)  # when Fabric is built, before any work
        super()._configure_launcher()

    # --- setup -------------------------------------------------------------------------------------
    # Lightning's DataParallelStrategy types this as returning torch's DataParallel, the wrapper this one replaces
    def setup_module(self, module: nn.Module) -> StepReplicas:  # type: ignore[override]
        replicas = StepReplicas(module, self.mode, self._devices, **self.options)
        replicas.defers = self._defers
        self._wrappers.append(replicas)
        return replicas

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: T | None = None
    ) -> tuple[StepReplicas, list[torch.optim.Optimizer], T | None]:
        replicas = self.setup_module(module)
        for optimizer in optimizers:
            replicas.stepper(optimizer)  # built now, so a bad optimizer is refused at setup
        return replicas, optimizers, scheduler

    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    def setup_criterion(self, criterion: Callable) -> Callable:
        """criterion(model(x), *targets) computed inside each replica on its rows (a mean over rows), the
        replicas' losses weighted by their rows; outside training (eval, no_grad) the plain criterion."""
        if not callable(criterion):
            raise TypeError(
                f"criterion: expected a callable loss such as nn.CrossEntropyLoss(), got {type(criterion).__name__}"
            )
        precision = self.precision

        def in_replicas(output: Any, *targets: Any) -> Any:
            if isinstance(output, DeferredForward):
                with precision.forward_context():
                    return output.replicas.run(
                        "forward", output.args, output.kwargs, criterion=criterion, targets=targets
                    )
            return criterion(output, *targets)

        self._defers = True  # from now on a model's training forward waits for this criterion
        for replicas in self._wrappers:
            replicas.defers = True
        return in_replicas

    # --- the step ----------------------------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        wrappers = [module] if isinstance(module, StepReplicas) else self._wrappers
        for replicas in wrappers:
            replicas.before_backward()
        super().backward(tensor, module, *args, **kwargs)
        for replicas in wrappers:
            replicas.after_backward()

    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        stepper = next((r.steppers[id(optimizer)] for r in self._wrappers if id(optimizer) in r.steppers), None)
        if stepper is None:
            return super().optimizer_step(optimizer, **kwargs)
        closure = kwargs.pop("closure", None)
        if kwargs:
            raise TypeError(
                f"optimizer.step: mode {self.mode!r} steps the replicas' optimizer, which takes no arguments; "
                f"got {sorted(kwargs)}"
            )
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        for replicas in self._wrappers:
            if id(optimizer) in replicas.steppers:
                replicas.before_step()
        stepper.step()
        return result

    # --- one process: collectives are identities ---------------------------------------------------
    def all_reduce(self, collection: T, group: object = None, reduce_op: object = "mean") -> T:
        return collection

    # --- checkpoints -------------------------------------------------------------------------------
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return super().get_module_state_dict(module.module if isinstance(module, StepReplicas) else module)

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        bare = module.module if isinstance(module, StepReplicas) else module
        super().load_module_state_dict(bare, state_dict, strict=strict)
        for replicas in self._wrappers:
            if replicas is module or replicas.module is bare:
                replicas.weights_loaded()

    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | torch.optim.Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        for replicas in self._wrappers:
            replicas.optimizers_loaded()
        return remainder

    def teardown(self) -> None:
        for replicas in self._wrappers:
            replicas.close()
        self._wrappers = []
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(cls, strategy_registry)
