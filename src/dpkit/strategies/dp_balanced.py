"""dp-balanced: DataParallel with the loss computed inside each replica and memory-balanced chunks.

Computing the loss in the replicas means the full output never lands on the first device, only one
scalar per replica; chunk sizes follow measured memory, so the first device is not the one that runs out.
In the user's loop `model(x)` returns a DeferredOutput while training, and the criterion from
`engine.setup_criterion(criterion)` runs `DataParallel(..., loss_fn=criterion, balance="memory")(x, target=y)`,
which weights each replica's mean loss by its share of the batch. Outside training (eval, no_grad) `model(x)` returns
the gathered outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dpkit.observe import measured_balance  # noqa: F401  (plugs the measured balance into the seam)
from dpkit.parallel import hooks
from dpkit.parallel.data_parallel import StatefulChunkPlanner
from dpkit.strategies.base import (
    IN_REPLICAS,
    ONE_PROCESS,
    PER_STEP,
    DeferredOutput,
    Strategy,
    Traits,
    criterion_sums,
    defers,
)
from dpkit.strategies.dp import LossMeanDataParallel


class DPBalancedModule(nn.Module):
    """DataParallel with loss_fn and balance="memory"; in training, outputs are deferred to the criterion."""

    wraps_module = True  # dpkit.unwrap_model / save_model / load_model look inside

    def __init__(self, strategy: DPBalanced, data_parallel: nn.Module):
        super().__init__()
        self.strategy = strategy
        self.module = data_parallel  # state_dict keys "module.module.…", which save_model strips

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if defers(self.strategy, self):
            return DeferredOutput(self.strategy.name, args, kwargs, run=lambda: self.module(*args, **kwargs))
        return self.module(*args, **kwargs)


class DPBalanced(Strategy):
    name = "dp-balanced"
    traits = Traits(processes=ONE_PROCESS, loss=IN_REPLICAS, replicas=PER_STEP, balances=True)
    data_parallel: LossMeanDataParallel | None = None  # set by wrap_model

    def wrap_model(self, model: nn.Module) -> nn.Module:
        # a loss the model computes (0-dim per replica) is gathered as the row-weighted mean, as under dp
        self.data_parallel = LossMeanDataParallel(model.to(self.root_device), self.devices, balance="memory")
        return DPBalancedModule(self, self.data_parallel)

    def wrap_criterion(self, criterion: Callable) -> Callable:
        data_parallel = self.data_parallel
        if data_parallel is None:
            raise RuntimeError("criterion: dp-balanced wraps the criterion of a model it wrapped; wrap the model first")
        self.criterion = criterion
        data_parallel.loss_fn = criterion  # dp(x, target=y) now returns the loss; dp(x) still the outputs
        # a criterion that sums its rows: the replicas' sums are added (value and gradient)
        data_parallel.loss_reduction = "sum" if criterion_sums(criterion) else "mean"

        def loss_in_replicas(output: DeferredOutput, *targets: Any, **criterion_kwargs: Any) -> torch.Tensor:
            if criterion_kwargs or len(targets) != 1:
                raise TypeError(
                    "criterion: strategy 'dp-balanced' calls the loss inside the replicas "
                    "as criterion(output, target); "
                    f"got {len(targets)} targets and keywords {sorted(criterion_kwargs)}; "
                    "bind extra arguments into the "
                    "criterion (e.g. nn.CrossEntropyLoss(label_smoothing=0.1))"
                )
            return data_parallel(*output.args, target=targets[0], **output.kwargs)

        return loss_in_replicas

    def loss_is_sum(self) -> None:
        # the replicas' losses are sums over their items: added, not weighted by rows
        if self.data_parallel is not None and self.data_parallel.last_weights is not None:
            self.data_parallel.last_weights.as_sum()
            self.data_parallel.last_weights = None

    def backward(self, loss: torch.Tensor, *, scale: float, sync: bool) -> None:
        with hooks.phase("backward", self.root_device):
            super().backward(loss, scale=scale, sync=sync)

    # --- resumable state: the balancer's measurements and chosen splits, so that a resumed run splits its
    # batches, and so rounds and draws dropout masks, as the saved run did
    def _planner(self) -> StatefulChunkPlanner | None:
        if self.data_parallel is None:
            return None
        planner = self.data_parallel.balancer
        if not isinstance(planner, StatefulChunkPlanner):  # (balance="memory" plugs in dpkit.observe's: it is)
            raise TypeError(
                f"balance: dp-balanced resumes its planner's state; {type(planner).__name__} has no state_dict()"
            )
        return planner

    def state_dict(self) -> dict[str, Any]:
        planner = self._planner()
        return planner.state_dict() if planner is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        planner = self._planner()
        if planner is not None and state:
            planner.load_state_dict(state)
