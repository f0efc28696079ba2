"""single: the whole global batch on one device; the reference every other strategy must equal."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager

import torch
from torch import nn

from dpkit.parallel import hooks
from dpkit.parallel.scatter import batch_size_of
from dpkit.strategies.base import NO_REPLICAS, ON_ROOT, ONE_PROCESS, Strategy, Traits


@contextlib.contextmanager
def one_device_forward(module: nn.Module | None, device: torch.device, args: tuple, kwargs: dict) -> Iterator[None]:
    """Announce a one-device forward through the seam: the step's rows on `device`, then the "forward" phase."""
    if hooks.listening() and module is not None:
        rows = batch_size_of(args, kwargs, 0)
        hooks.split(module, [device], device, [0 if rows is None else rows])
    with hooks.phase("forward", device):
        yield


class Single(Strategy):
    name = "single"
    traits = Traits(processes=ONE_PROCESS, loss=ON_ROOT, replicas=NO_REPLICAS, max_devices=1)

    def __init__(self, devices: Sequence[torch.device], *, precision: str = "32"):
        super().__init__(devices, precision=precision)
        self.model: nn.Module | None = None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self.model = super().wrap_model(model)
        return self.model

    def forward_context(self, args: tuple, kwargs: dict) -> AbstractContextManager:
        return one_device_forward(self.model, self.root_device, args, kwargs)

    def backward(self, loss: torch.Tensor, *, scale: float, sync: bool) -> None:
        with hooks.phase("backward", self.root_device):
            super().backward(loss, scale=scale, sync=sync)
