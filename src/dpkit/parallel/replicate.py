"""Copies of a module on each device, differentiable back to the original parameters.

The replica on the primary device is the module itself: its parameters are the originals and buffers
it updates in place (BatchNorm running statistics) persist, as in torch's DataParallel. On every other
device the parameters are differentiable copies, so backward sums each replica's gradient onto the
original parameter. Buffers are copied without gradient unless they require one.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        # a virtual CPU device still gets its own copy: the replica may update it in place
        return tensor.clone()
    return tensor.to(device, non_blocking=True, copy=True)


def replicate_to(module: nn.Module, device: torch.device) -> nn.Module:
    """One replica of `module` on `device` whose parameters flow gradients back to the originals."""
    copies: dict[int, torch.Tensor] = {}

    def copy_of(tensor: torch.Tensor, *, keep_grad: bool) -> torch.Tensor:
        key = id(tensor)
        if key not in copies:
            source = tensor if keep_grad else tensor.detach()
            copies[key] = _copy_to(source, device)
        return copies[key]

    originals = list(module.modules())
    # torch's own hook keeps module-specific replica state right (e.g. RNN flat weights)
    replicas = {id(m): m._replicate_for_data_parallel() for m in originals}
    for original in originals:
        replica = replicas[id(original)]
        for name, child in original._modules.items():
            replica._modules[name] = None if child is None else replicas[id(child)]
        for name, param in original._parameters.items():
            if param is not None:
                setattr(replica, name, copy_of(param, keep_grad=param.requires_grad))
            else:
                setattr(replica, name, None)
        for name, buffer in original._buffers.items():
            if buffer is not None:
                replica._buffers[name] = copy_of(buffer, keep_grad=buffer.requires_grad)
    return replicas[id(module)]


def replicate(module: nn.Module, devices: Sequence[torch.device], primary: torch.device) -> list[nn.Module]:
    """A replica per device; the primary device's replica is `module` itself."""
    return [module if device == primary else replicate_to(module, device) for device in devices]
