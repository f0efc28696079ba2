"""Checks of what a training loop hands the Engine: the arguments of engine.setup and engine.backward, in one
line each before any work; where a mistake would otherwise train nothing silently, an optimizer built over
parameters that are not the model's (another instance, a foreign tensor mixed in); and the opt-in check of
non-finite losses (and the error it raises)."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from dpkit.errors import DpkitError

if TYPE_CHECKING:
    from dpkit.strategies import Strategy

log = logging.getLogger("dpkit")

# Engine(nonfinite_loss=...): no check, log the first non-finite loss, or stop at it
NONFINITE_LOSS = (None, "warn", "raise")


class NonFiniteLoss(DpkitError):
    """engine.backward got a loss that is nan or inf (Engine(nonfinite_loss='raise'))."""


def check_setup(model: object, optimizer: object, *, set_up_before: bool) -> None:
    """engine.setup's arguments: a module, an optimizer (or None) over that module's parameters, a first setup."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if set_up_before:
        raise RuntimeError("engine.setup: this engine already set up a model; create one Engine per model")
    if optimizer is None:
        return
    if not hasattr(optimizer, "step") or not hasattr(optimizer, "param_groups"):  # (an optimizer by its duck)
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_optimizer_of(model, cast(torch.optim.Optimizer, optimizer))


def check_loss(loss: object) -> None:
    """engine.backward's loss: one value (torch's own error for a vector names no argument)."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss: expected a tensor, got {type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(
            f"loss: expected one value (a 0-dim mean or sum over the batch), got shape {tuple(loss.shape)}; "
            "reduce it first, e.g. loss.mean()"
        )


def check_optimizer_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
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


class LossCheck:
    """Engine(nonfinite_loss="warn" | "raise"): warn about, or stop at, a loss that is nan or inf in any process
    (all processes agree, so that every one stops at the same step)."""

    def __init__(self, mode: str | None):
        if mode not in NONFINITE_LOSS:
            raise ValueError(
                f"nonfinite_loss: expected None (no check), 'warn' or 'raise', got {mode!r}; 'warn' logs "
                "the first step whose loss is nan or inf, 'raise' stops there with NonFiniteLoss"
            )
        self.mode = mode
        self.warned = False

    def __call__(self, loss: torch.Tensor, strategy: Strategy, *, step: int, micro_batch: int, accumulate: int) -> None:
        """Check the loss of micro-batch `micro_batch` (1-based) of `accumulate` before optimizer step `step`."""
        if self.mode is None:
            return
        value = float(loss.detach().float().sum())
        bad = torch.tensor(0.0 if math.isfinite(value) else 1.0)
        if strategy.world_size > 1:
            bad = strategy.all_reduce(bad, "sum")
        if not bad:
            return
        what = f"{value:g}" if not math.isfinite(value) else "nan or inf in another process"
        message = (
            f"engine.backward: the loss is {what} at step {step}"
            + (f" (micro-batch {micro_batch} of {accumulate})" if accumulate > 1 else "")
            + "; the step would make every weight it touches nan: lower the learning rate, clip the gradients "
            "(engine.clip_gradients) or look at the batch"
        )
        if self.mode == "raise":
            raise NonFiniteLoss(message)
        if not self.warned:
            self.warned = True  # said once: a run that diverged stays diverged
            log.warning("%s", message)
