"""dp: dpkit.DataParallel. Each forward scatters the batch, replicates the model, gathers the outputs on
the first device, where the loss and its backward run as on one device.

A loss the model computes itself (transformers' `labels`) comes back from each replica as one 0-dim mean
over its rows; torch's DataParallel, and dpkit.DataParallel by default, gather those as a vector. Under the
strategy they are gathered as their mean weighted by each replica's rows (`LossMeanDataParallel`): one
scalar for `engine.backward`, the whole batch's mean, as a criterion on gathered outputs gives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dpkit.parallel import DataParallel, hooks
from dpkit.parallel.concurrency import site_policies
from dpkit.parallel.data_parallel import CONCURRENCY_SITES
from dpkit.parallel.gather import ROW_MEAN, gather
from dpkit.parallel.scatter import other_sizes
from dpkit.strategies.base import ON_ROOT, ONE_PROCESS, PER_STEP, Strategy, Traits


class ReplicaWeights:
    """The weights a combined loss gives its replicas' losses in backward: their shares of the rows, or 1 each
    once the loss turns out to be a sum over items (engine.backward(loss, items=n))."""

    def __init__(self, rows: Sequence[int]):
        total = sum(rows)
        self.weights = [n / total for n in rows]

    def as_sum(self) -> None:
        self.weights = [1.0] * len(self.weights)


class WeightedLosses(torch.autograd.Function):
    """Σ weight_i · loss_i, with the weights read when backward runs."""

    @staticmethod
    def forward(ctx: Any, weights: ReplicaWeights, *losses: torch.Tensor) -> torch.Tensor:
        ctx.weights = weights
        return torch.stack([loss * w for loss, w in zip(losses, weights.weights)]).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (None, *[grad * w for w in ctx.weights.weights])


class LossMeanDataParallel(DataParallel):
    """DataParallel whose replicas' 0-dim floating outputs (a loss the model computed) are gathered as their
    row-weighted mean instead of a vector with one value per replica; with loss_fn, its replicas' mean losses
    are combined with weights that a summed loss (engine.backward(loss, items=n)) turns into 1 each."""

    last_weights: ReplicaWeights | None = None  # those of the latest combined loss

    def combine(
        self, outputs: list[Any], sizes: Sequence[int], with_loss: bool, inputs: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if with_loss and self.loss_reduction == "mean":
            rows = [s for s in sizes if s > 0]
            with hooks.phase("loss", self.output_device):
                self.last_weights = ReplicaWeights(rows)
                moved = [loss.to(self.output_device) for loss in outputs]
                return WeightedLosses.apply(self.last_weights, *moved)
        if with_loss:  # a criterion that sums its rows: the replicas' sums are added
            self.last_weights = None
            return super().combine(outputs, sizes, with_loss, inputs, kwargs)
        with hooks.phase("gather", self.output_device):
            return gather(
                outputs,
                self.output_device,
                self.dim,
                rows=[s for s in sizes if s > 0],
                input_sizes=sorted(other_sizes((inputs, kwargs or {}), self.dim)),
                scalars=ROW_MEAN,
            )


class DP(Strategy):
    name = "dp"
    traits = Traits(processes=ONE_PROCESS, loss=ON_ROOT, replicas=PER_STEP)
    options = ("concurrency",)

    def __init__(
        self, devices: Sequence[torch.device], *, concurrency: str | Mapping[str, str] = "auto", precision: str = "32"
    ):
        super().__init__(devices, precision=precision)
        site_policies(concurrency, CONCURRENCY_SITES)  # a bad value is named here, before any model
        self.concurrency = concurrency
        self.wrapper: LossMeanDataParallel | None = None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self.wrapper = LossMeanDataParallel(model.to(self.root_device), self.devices, concurrency=self.concurrency)
        return self.wrapper

    def concurrency_choice(self) -> dict[str, str]:
        return self.wrapper.concurrency_choice() if self.wrapper is not None else {}

    def set_concurrency(self, concurrency: str | Mapping[str, str]) -> None:
        self.concurrency = concurrency
        if self.wrapper is not None:
            self.wrapper.set_concurrency(concurrency)

    def backward(self, loss: torch.Tensor, *, scale: float, sync: bool) -> None:
        # on the output device; listeners attribute the replicas' autograd nodes to their own devices
        with hooks.phase("backward", self.root_device):
            super().backward(loss, scale=scale, sync=sync)
