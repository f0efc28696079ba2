"""dpkit's one-process data parallelism as a strategy for Lightning's Trainer.

    trainer = lightning.Trainer(strategy=DataParallelStrategy("replicated", devices=["cpu:0", "cpu:1"]))

It is a single-device strategy as far as the Trainer knows (one process, rank 0 of 1, no distributed
sampler: every batch is the global batch), whose step methods run in dpkit's replicas (replicas.py):

- training_step, validation_step, test_step and predict_step run in the replicas inside the precision
  plugin's step contexts (autocast reaches every replica's thread), and come back as one device's result;
- the backward is Lightning's own (LightningModule.backward); under `replicated` the loss it runs through
  sums the replicas' gradients, and the optimizer is stepped by the persistent replicas' optimizer after
  Lightning's closure, hooks and gradient clipping;
- checkpoints hold the LightningModule's own state dict (clean keys); a loaded one reaches the replicas;
- Trainer(sync_batchnorm=True) converts BatchNorm layers to SyncBatchNorm, which dpkit's replicas compute
  over the whole batch.

Manual optimization is refused when training starts: the optimizer would step once per replica.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import nn

from dpkit.devices import DeviceLike
from dpkit.integrations.lightning.arguments import check_devices, check_mode, check_options, resolve_devices
from dpkit.integrations.lightning.replicas import StepReplicas
from dpkit.strategies import strategy_class

# the names Lightning knows them by: Trainer(strategy="dpkit_replicated", accelerator="cpu", devices=2)
REGISTERED_NAMES = {"dpkit_dp": "dp", "dpkit_dp_balanced": "dp-balanced", "dpkit_replicated": "replicated"}


def register_names(cls: type, strategy_registry: _StrategyRegistry) -> None:
    """REGISTERED_NAMES in a Lightning strategy registry (the Trainer's or Fabric's), each for `cls` in its mode."""
    for name, mode in REGISTERED_NAMES.items():
        if name not in strategy_registry:
            strategy_registry.register(
                name, cls, description=f"dpkit's {mode} in one process (a replica per device)", mode=mode
            )


def check_precision(precision_plugin: object, mode: str) -> None:
    """A GradScaler (precision '16-mixed') only with the modes whose dpkit strategy supports one."""
    if getattr(precision_plugin, "scaler", None) is not None and not strategy_class(mode).traits.grad_scaler:
        raise ValueError(
            f"precision: '16-mixed' is not supported with mode {mode!r} yet; use precision='bf16-mixed', or mode "
            "'dp' or 'dp-balanced'"
        )


class DataParallelStrategy(SingleDeviceStrategy):
    """Lightning Trainer strategy: the LightningModule's steps in dpkit replicas, one process.

    Args:
        mode: "dp" (dpkit.DataParallel: replicas copied from the module at every step, even shares),
            "dp-balanced" (the same, rows per device chosen from measured memory) or "replicated"
            (persistent replicas whose backward runs in their own threads; gradients summed among them).
        devices: ["cpu:0", "cpu:1"] (virtual CPU devices), [0, 1] or ["cuda:0", "cuda:1"] (GPUs), a count
            (devices of the Trainer's accelerator), or None (the Trainer's devices=, on CPU as virtual
            devices cpu:0 ... cpu:N-1).
        **options: the dpkit strategy's options (replicated: threads_per_device, overlap_reduce, share_weights).
    """

    strategy_name = "dpkit"

    def __init__(self, mode: str = "dp", devices: Sequence[DeviceLike] | int | None = None, **options: Any):
        self.mode = check_mode(mode)
        self.options = check_options(self.mode, options)
        self._asked = check_devices(devices)
        self._devices: list[torch.device] = resolve_devices(self._asked, None)
        super().__init__(device=self._devices[0] if self._devices else "cpu")
        self._layer_sync = None  # Trainer(sync_batchnorm=True) sets it (the connector looks for the attribute)
        self.replicas: StepReplicas | None = None

    # --- where it runs -----------------------------------------------------------------------------
    @property
    def parallel_devices(self) -> list[torch.device]:
        return list(self._devices)

    @parallel_devices.setter
    def parallel_devices(self, devices: Sequence[torch.device | str | int]) -> None:
        # the connector offers the devices of Trainer(accelerator=..., devices=...) when ours are not known yet
        self._devices = resolve_devices(self._asked, devices)

    @property
    def root_device(self) -> torch.device:
        return self._devices[0] if self._devices else self._root_device

    def _configure_launcher(self) -> None:
        # called when the Trainer is built, after its precision plugin is set: refuse here, before any work
        check_precision(self.precision_plugin, self.mode)
        super()._configure_launcher()

    # --- setup -------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING and module is not None and not module.automatic_optimization:
            raise ValueError(
                f"automatic_optimization: {type(module).__name__} sets it to False, but dpkit's "
                "DataParallelStrategy runs training_step in every replica, where a manual optimizer.step() "
                "would step once per replica; use automatic optimization, or Lightning's own strategy"
            )
        check_precision(self.precision_plugin, self.mode)
        if self._layer_sync is not None:
            self.model = self._layer_sync.apply(self.model)
        super().setup(trainer)
        for optimizer in self.optimizers:  # the replicas' optimizers now: one that cannot be built fails here
            self._step_replicas().stepper(optimizer)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if self.replicas is not None:
            self.replicas.close()
        self.replicas = StepReplicas(model, self.mode, self._devices, **self.options)
        return self.replicas

    def _step_replicas(self) -> StepReplicas:
        if self.replicas is None:
            raise RuntimeError("DataParallelStrategy: the model is not set up yet (the Trainer sets it up in fit)")
        return self.replicas

    # --- the steps ---------------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.train_step_context():
            return self._step_replicas().run("training_step", args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.val_step_context():
            return self._step_replicas().run("validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.test_step_context():
            return self._step_replicas().run("test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._step_replicas().run("predict_step", args, kwargs)

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        self._step_replicas().before_backward()

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        self._step_replicas().after_backward()

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        stepper = self.replicas.stepper(optimizer) if self.replicas is not None else None
        if stepper is None:  # per-step replicas: the module's own optimizer steps the module
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if kwargs:
            raise TypeError(
                f"optimizer.step: mode {self.mode!r} steps the replicas' optimizer, which takes no arguments; "
                f"got {sorted(kwargs)}"
            )
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule)  # as Lightning's own Strategy.optimizer_step asserts
        # what Lightning's precision plugin does around optimizer.step(closure): the step and backward, then
        # on_before_optimizer_step and gradient clipping; then the replicas' optimizer steps (it takes no closure)
        result = closure()
        self.precision_plugin._after_closure(model, optimizer)
        self._step_replicas().before_step()
        stepper.step()
        return result

    # --- checkpoints -------------------------------------------------------------------------------
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.replicas is not None:
            self.replicas.weights_loaded()

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self.replicas is not None:
            for optimizer in self.optimizers:
                self.replicas.stepper(optimizer)
            self.replicas.optimizers_loaded()

    def teardown(self) -> None:
        if self.replicas is not None:
            self.replicas.close()
            self.replicas = None
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(cls, strategy_registry)
