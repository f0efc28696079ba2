"""replicated's loss: the replicas' losses behind one autograd node, so a plain `loss.backward()` runs
every replica's backward in its own thread and then the gradient sum.

The criterion returns `CombinedLoss.apply(step, anchor)`: a 0-dim tensor whose value is the
sample-weighted mean of the replicas' losses and whose only autograd input is a throwaway leaf, so the
autograd engine never walks into the replicas' graphs on the calling thread. Its backward hands the
incoming gradient to `step.backward`, which scales it by each replica's share and runs the replicas'
backwards (and the sum) through dpkit.parallel.reduce. Arithmetic on the returned loss (a factor, a
term that does not touch the model) therefore works as on any tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from dpkit.parallel.reduce import GradientSum


class ReplicaStep:
    """The replicas' losses of one forward and what to do with the gradient that reaches them."""

    joined = False  # the replicas' graphs share nodes (SyncBatchNorm): one autograd pass must run them all

    def __init__(
        self,
        indices: Sequence[int],
        losses: Sequence[torch.Tensor],
        weights: Sequence[float],
        gradients: GradientSum,
        sync: Callable[[], bool],
        ran: Callable[[], None],
    ):
        self.indices = list(indices)
        self.losses: list[torch.Tensor] | None = list(losses)
        self.weights = list(weights)
        self.gradients = gradients
        self.sync = sync  # whether this backward ends with the sum (False inside an accumulation)
        self.ran = ran  # told that the replicas' backward (and sum) ran

    def value(self, device: torch.device) -> torch.Tensor:
        if self.losses is None:
            raise RuntimeError("loss: the replicas' losses were freed by the backward through them")
        with torch.no_grad():
            terms = [w * loss.detach().to(device) for w, loss in zip(self.weights, self.losses)]
            # typeshed's sum() is int | Tensor (the start, 0, when empty); there is a loss per replica
            return sum(terms)  # type: ignore[return-value]

    def backward(self, grad_output: torch.Tensor) -> None:
        if self.losses is None:
            raise RuntimeError(
                "loss: backward through a replicated loss ran twice; its replicas' graphs are freed after the first"
            )
        roots = [
            (i, loss, (grad_output * w).to(loss.device)) for i, loss, w in zip(self.indices, self.losses, self.weights)
        ]
        self.losses = None  # the graphs are freed by this backward
        if self.joined:  # a per-replica backward would walk into the other replicas' graphs
            self.gradients.release_copies()
            torch.autograd.backward([loss for _, loss, _ in roots], [grad for _, _, grad in roots])
            if self.sync():
                self.gradients.sum_now()
        else:
            self.gradients.backward(roots, sync=self.sync())
        self.ran()


class CombinedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, step: ReplicaStep, anchor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx.step = step
        return value.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[None, None, None]:
        ctx.step.backward(grad_output)
        return None, None, None


def combined_loss(step: ReplicaStep, device: torch.device) -> torch.Tensor:
    """The loss the user sees: the weighted mean of the replicas' losses, differentiable through `step`."""
    anchor = torch.zeros((), device=device, requires_grad=True)
    return CombinedLoss.apply(step, anchor, step.value(device))
