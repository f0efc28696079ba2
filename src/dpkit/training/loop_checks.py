"""Checks of what a training loop hands the Engine, made where a mistake would otherwise train nothing silently:
an optimizer built over parameters that are not the model's (another instance, a foreign tensor mixed in), and
the name of the error an opt-in check of non-finite losses raises."""

from __future__ import annotations

from typing import Any

from torch import nn

from dpkit.errors import DpkitError

# Engine(nonfinite_loss=...): no check, log the first non-finite loss, or stop at it
NONFINITE_LOSS = (None, "warn", "raise")


class NonFiniteLoss(DpkitError):
    """engine.backward got a loss that is nan or inf (Engine(nonfinite_loss='raise'))."""


def check_optimizer_of(model: nn.Module, optimizer: Any) -> None:
    """Raise ValueError unless every parameter `optimizer` updates is one of `model`'s: an optimizer over another
    model's parameters steps them while the model trained never changes (an optimizer over part of the model, as
    in fine-tuning, is fine)."""
    own = {id(parameter) for parameter in model.parameters()}
    given = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    foreign = [parameter for parameter in given if id(parameter) not in own]
    if foreign:
        raise ValueError(
            f"optimizer: {len(foreign)} of its {len(given)} parameters are not the model's (the first has shape "
            f"{tuple(foreign[0].shape)}), so steps would leave the model as it is; build the optimizer from this "
            "model's parameters, e.g. torch.optim.SGD(model.parameters(), lr=0.1), after creating the model and "
            "before engine.setup(model, optimizer)"
        )
