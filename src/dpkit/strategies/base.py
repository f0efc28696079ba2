"""What every strategy provides, and the deferred output of the loss-in-replicas strategies.

A strategy decides how devices cooperate in one step: how the model and optimizer are wrapped, which
part of the global batch this process sees, how backward turns into one gradient equal to a
single-device step, and how values are reduced across processes. The base class is the one-process,
one-device behaviour; a strategy overrides only what differs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn


class Strategy:
    name = "single"
    supports_grad_scaler = True
    # one process: rank 0 of 1; the ddp strategy overrides these from the launcher's environment
    rank = 0
    world_size = 1

    def __init__(self, devices: Sequence[torch.device]):
        self.devices = list(devices)
        self.criterion: Callable | None = None  # set by loss-in-replicas strategies

    @property
    def root_device(self) -> torch.device:
        """Where this process keeps the model and puts the batches it receives."""
        return self.devices[0]

    def setup_environment(self) -> None:
        """Prepare the process (threads, process group) before any model is wrapped."""

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model.to(self.root_device)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        return optimizer

    def wrap_criterion(self, criterion: Callable) -> Callable:
        """Strategies that compute the loss inside replicas return a callable taking a DeferredOutput."""
        return criterion

    def wrap_dataloader(self, loader: Any) -> Any:
        """The loader this process iterates; one process sees the whole global batch."""
        return loader

    def backward(self, loss: torch.Tensor, *, scale: float, sync: bool) -> None:
        """Gradients of `loss * scale`; `sync` is False on the micro-batches of an accumulation."""
        (loss * scale if scale != 1.0 else loss).backward()

    def forward_context(self, args: tuple, kwargs: dict) -> ContextManager:
        """Entered around the model's forward in the user's loop. Strategies whose forward announces its
        own phases through dpkit.parallel.hooks (DataParallel's scatter/forward/gather) leave it empty."""
        return contextlib.nullcontext()

    def weights_loaded(self) -> None:
        """The user's model just received new weights (engine.load); copies elsewhere must follow."""

    # across processes: identities in one process
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's `obj` (picklable), in rank order."""
        return [obj]

    def barrier(self) -> None:
        pass

    def teardown(self) -> None:
        pass


@dataclass
class DeferredOutput:
    """What `model(x)` returns while training under a loss-in-replicas strategy (dp-balanced, replicated).

    The forward has not run yet: it runs in each replica, on its slice of the batch, together with the
    loss, when the criterion from `engine.setup_criterion(...)` receives this object and the targets.
    """

    strategy_name: str
    args: tuple
    kwargs: dict

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"model(x) under strategy '{self.strategy_name}' returns a deferred output (no .{name}): the forward runs "
            "inside the replicas together with the loss. Pass it to the criterion returned by "
            "engine.setup_criterion(criterion); for plain outputs call model.eval() or use torch.no_grad()"
        )

    def __repr__(self) -> str:
        return f"DeferredOutput(strategy={self.strategy_name!r}, {len(self.args)} args, kwargs={sorted(self.kwargs)})"


def defers(strategy: Strategy, module: nn.Module) -> bool:
    """Whether a forward should be deferred to the criterion: training, with grad, criterion set up."""
    return strategy.criterion is not None and module.training and torch.is_grad_enabled()
