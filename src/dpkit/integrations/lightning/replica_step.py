"""The replicas' side of a call: what each replica runs (ReplicaStep: one method of its copy of the module, its
log calls recorded, its random numbers drawn as one device would) and what it leaves in the call (StepCall)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpkit.integrations.lightning.logs import logs_values, recorded_logs
from dpkit.integrations.lightning.outputs import loss_of
from dpkit.parallel.whole_batch_rng import WholeBatchDraws

TRAINING_STEP = "training_step"
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
CALL_KEYWORD = "dpkit_call"  # keyword arguments that travel with the batch to every replica, never to the module
ROWS_KEYWORD = "dpkit_rows"
# what a replica hands back: its loss (the loss path), its output (forward: gathered by dpkit), or nothing
# (the other steps: their outputs are combined from the call's results)
RETURNS_LOSS, RETURNS_OUTPUT, RETURNS_NOTHING = "loss", "output", "nothing"


class StepCall:
    """One call into the replicas: what each replica ran, filled in by the replicas' threads and keyed by
    the replica's first row. (A plain class: dpkit's scatter passes it to every replica unchanged.)"""

    def __init__(self, method: str, total: int, returns: str, state: torch.Tensor | None):
        self.method = method
        self.total = total
        self.returns = returns
        self.state = state  # the default generator's state before the step; None: replicas draw as dpkit does
        self.results: dict[int, ReplicaResult] = {}


class ReplicaResult:
    __slots__ = ("rows", "output", "logs", "draws")

    def __init__(self, rows: int, output: object, logs: list, draws: WholeBatchDraws | None):
        self.rows, self.output, self.logs, self.draws = rows, output, logs, draws


class ReplicaStep(nn.Module):
    """What each replica runs: one method of its copy of the module, its log calls recorded, its random
    numbers drawn as one device would (virtual CPU devices)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        call: StepCall = kwargs.pop(CALL_KEYWORD)
        rows = kwargs.pop(ROWS_KEYWORD)
        offset, count = int(rows[0]), rows.numel()
        module = self.module
        if rows.device.type != "cpu" and module.__dict__.get("_device", rows.device) != rows.device:
            module.__dict__["_device"] = rows.device  # a LightningModule's self.device, in this replica
        draws = WholeBatchDraws(call.state, offset, count, call.total) if call.state is not None else None
        with recorded_logs(module, logs_values(module)) as logs:
            if draws is not None:
                with draws:
                    output = call_method(module, call.method, args, kwargs)
            else:
                output = call_method(module, call.method, args, kwargs)
        if call.returns == RETURNS_LOSS:
            loss, rest = loss_of(call.method, output, rows.device)
            call.results[offset] = ReplicaResult(count, rest, logs, draws)
            return loss
        if call.returns == RETURNS_OUTPUT:
            call.results[offset] = ReplicaResult(count, None, logs, draws)
            return output
        call.results[offset] = ReplicaResult(count, output, logs, draws)
        return None


def call_method(module: nn.Module, method: str, args: tuple, kwargs: dict) -> Any:
    """`module.<method>(*args, **kwargs)`; `forward` through the module's call (its hooks)."""
    return module(*args, **kwargs) if method == "forward" else getattr(module, method)(*args, **kwargs)
