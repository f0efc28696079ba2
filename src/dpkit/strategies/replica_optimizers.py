"""replicated's optimizers: the user's optimizer steps replica 0, a clone of it steps each other replica."""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, Sequence

import torch
from torch import nn

from dpkit.parallel import hooks
from dpkit.parallel.apply import run_replicas


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's defaults its constructor accepts (some defaults are not constructor arguments,
    e.g. AdamW's decoupled_weight_decay); every param group carries its own values anyway."""
    parameters = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters}


def clone_optimizer(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter],
                    replica_params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The same optimizer (type, groups, hyperparameters, state) over `replica_params`, which correspond
    position by position to `params`, the parameters `optimizer` was built over."""
    position = {id(p): k for k, p in enumerate(params)}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in position:
                raise ValueError(
                    f"optimizer: param_groups[{g}] holds a tensor that is not one of the model's parameters; "
                    "build the optimizer from model.parameters() and pass both to engine.setup(model, optimizer)"
                )
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [replica_params[position[id(p)]] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    name = type(optimizer).__name__
    try:
        clone = type(optimizer)(groups, **_constructor_defaults(optimizer))
    except TypeError as error:
        raise TypeError(
            f"optimizer: strategy 'replicated' builds one {name} per replica as {name}(param_groups, **defaults), "
            f"which failed ({error}); use strategy='ddp' for this optimizer"
        ) from error
    clone.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return clone


class ReplicaOptimizers:
    """The user's optimizer (replica 0's) and a clone per other replica; step() steps each replica in its
    device's thread, after copying the user's hyperparameters (a scheduler's lr) to the clones."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], devices: Sequence[torch.device], threads: int | None):
        self.optimizers = optimizers
        self.devices = list(devices)
        self.threads = threads

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizers[0].param_groups

    @property
    def state(self) -> Any:
        return self.optimizers[0].state

    @property
    def defaults(self) -> dict:
        return self.optimizers[0].defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable | None = None) -> None:
        if closure is not None:
            raise TypeError("optimizer.step(closure): strategy 'replicated' steps every replica once and takes no closure")
        first = self.optimizers[0].param_groups
        for optimizer in self.optimizers[1:]:
            for mine, theirs in zip(optimizer.param_groups, first):
                for key, value in theirs.items():
                    if key != "params":
                        mine[key] = value

        def step_one(i: int) -> None:
            with hooks.replica_phase("optimizer"):
                self.optimizers[i].step()

        run_replicas(self.devices, step_one, generators=False, threads=self.threads)

    def state_dict(self) -> dict:
        return self.optimizers[0].state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        for optimizer in self.optimizers:
            optimizer.load_state_dict(copy.deepcopy(state_dict))
