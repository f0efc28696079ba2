"""What a port from torchrun + DDP learns by trial, said once at run time where the run can tell
(docs/from-torchrun.md says all of it):

- a model that computes its own loss under a strategy that runs the loss in its replicas (replicated,
  dp-balanced): its other outputs (the logits) are gathered on the first device every step and the backward
  starts from there, where a criterion from engine.setup_criterion would run each replica's loss and backward
  in its own thread;
- the loss printed through engine.print under a strategy with a process per device: it is this process's, the
  mean over its share of the batch, not the global batch's.

Each note is a warning on dpkit's logger, once per Engine (the printed loss) or per model (its own loss).
"""

from __future__ import annotations

import logging
import math
import re
from typing import TYPE_CHECKING, Any

import torch

from dpkit.parallel.nested import leaves
from dpkit.strategies import IN_REPLICAS, PER_DEVICE, DeferredOutput

if TYPE_CHECKING:
    from dpkit.engine.wrappers import EngineModule
    from dpkit.strategies import Strategy

log = logging.getLogger("dpkit")

# a printed number: its digits after the point say how closely it was rounded
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d*\.(\d+)(?![\deE])")


def note_own_loss(model: EngineModule, output: Any) -> Any:
    """`output` unchanged; said once per model, when training under a strategy that runs the loss in its replicas,
    if what the model returned holds a loss it computed itself (a 0-dim tensor with a gradient) beside other
    outputs, which the strategy then gathers. A deferred output is checked when its forward runs on its own (the
    model's output used as it is, not handed to the criterion)."""
    if (
        model.__dict__.get("said_own_loss")
        or model.strategy.traits.loss != IN_REPLICAS
        or not (model.training and torch.is_grad_enabled())
    ):
        return output
    if isinstance(output, DeferredOutput):
        run = output.run
        if run is not None:
            output.run = lambda: _check_own_loss(model, run())
        return output
    return _check_own_loss(model, output)


def _check_own_loss(model: EngineModule, output: Any) -> Any:
    tensors = [value for _, value in leaves(output, "output") if isinstance(value, torch.Tensor)]
    own_loss = any(t.dim() == 0 and t.is_floating_point() and t.grad_fn is not None for t in tensors)
    gathered_bytes = sum(t.numel() * t.element_size() for t in tensors if t.dim() > 0)
    if own_loss and gathered_bytes and not model.__dict__.get("said_own_loss"):
        model.__dict__["said_own_loss"] = True
        log.warning(
            "model(x) returned a loss it computed itself under strategy '%s': its other outputs (%s this step, "
            "the logits) are gathered on the first device at every step and the backward starts from there; return "
            "the outputs alone and compute the loss with criterion = engine.setup_criterion(loss_fn), "
            "criterion(model(x), y), so that each replica runs its loss and backward in its own thread "
            "(docs/from-torchrun.md)",
            model.strategy.name,
            f"{gathered_bytes / 2**20:.1f} MiB" if gathered_bytes >= 2**20 else f"{gathered_bytes / 1024:.1f} KiB",
        )
    return output


class PrintedLossNote:
    """engine.print of the loss under a strategy with a process per device: said once that it is this process's."""

    def __init__(self) -> None:
        self.last_loss: torch.Tensor | None = None  # the loss of the last engine.backward, detached
        self.said = False

    def backward(self, loss: torch.Tensor) -> None:
        if not self.said:
            self.last_loss = loss.detach()

    def printing(self, strategy: Strategy, world_size: int, args: tuple[object, ...]) -> None:
        """Before engine.print prints `args` on rank 0: the note, where one of them is the last loss."""
        if self.said or self.last_loss is None or strategy.traits.processes != PER_DEVICE or world_size < 2:
            return
        if not any(_is_the_loss(arg, self.last_loss) for arg in args):
            return
        self.said = True
        log.warning(
            "engine.print: the loss printed is this process's under strategy '%s', the mean over its share of the "
            "batch (rank 0 of %d), not the global batch's; engine.reduce(loss, 'mean', weight=len(y)) gives the "
            "global batch's mean (call it in every process)",
            strategy.name,
            world_size,
        )


def _is_the_loss(printed: object, loss: torch.Tensor) -> bool:
    """Whether a printed argument is `loss`: the tensor, its value, or its value written into a string (to the
    digits written, two at least)."""
    if isinstance(printed, torch.Tensor):
        return printed is loss or (printed.dim() == 0 and bool(printed.detach().cpu() == loss.cpu()))
    value = float(loss)
    if isinstance(printed, float):
        return math.isclose(printed, value, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(printed, str):
        for number in _NUMBER.finditer(printed):
            digits = len(number.group(1))
            if digits >= 2 and abs(float(number.group(0)) - value) <= 0.5 * 10.0**-digits * (1 + 1e-9):
                return True
    return False
