"""dp: dpkit.DataParallel. Each forward scatters the batch, replicates the model, gathers the outputs on
the first device, where the loss and its backward run as on one device."""

from __future__ import annotations

import torch
from torch import nn

from dpkit.parallel import DataParallel, hooks
from dpkit.strategies.base import ON_ROOT, ONE_PROCESS, PER_STEP, Strategy, Traits


class DP(Strategy):
    name = "dp"
    traits = Traits(processes=ONE_PROCESS, loss=ON_ROOT, replicas=PER_STEP)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return DataParallel(model.to(self.root_device), self.devices)

    def backward(self, loss: torch.Tensor, *, scale: float, sync: bool) -> None:
        # on the output device; listeners attribute the replicas' autograd nodes to their own devices
        with hooks.phase("backward", self.root_device):
            super().backward(loss, scale=scale, sync=sync)
