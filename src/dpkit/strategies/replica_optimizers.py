"""replicated's optimizers. On GPUs (ReplicaOptimizers) the user's optimizer steps replica 0 and a clone
of it steps each other replica; on virtual CPU devices (SharedOptimizer) the replicas share replica 0's
parameters and the user's optimizer steps once, its parameters split among the replica threads."""

from __future__ import annotations

import collections
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


def copy_hyperparameters(source_groups: Sequence[dict], target_groups: Sequence[dict]) -> None:
    """Every setting but the parameters, group by group (a scheduler's lr reaches the clones)."""
    for mine, theirs in zip(target_groups, source_groups):
        for key, value in theirs.items():
            if key != "params":
                mine[key] = value


def refuse_closure(closure: Callable | None) -> None:
    if closure is not None:
        raise TypeError("optimizer.step(closure): strategy 'replicated' steps every replica once and takes no closure")


class _UsersOptimizer:
    """What the user sees of replicated's optimizers: their own optimizer's groups, state and state dict."""

    user: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.user.param_groups

    @property
    def state(self) -> Any:
        return self.user.state

    @property
    def defaults(self) -> dict:
        return self.user.defaults

    def state_dict(self) -> dict:
        return self.user.state_dict()


class ReplicaOptimizers(_UsersOptimizer):
    """The user's optimizer (replica 0's) and a clone per other replica; step() steps each replica in its
    device's thread, after copying the user's hyperparameters (a scheduler's lr) to the clones."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], devices: Sequence[torch.device], threads: int | None):
        self.optimizers = optimizers
        self.user = optimizers[0]
        self.devices = list(devices)
        self.threads = threads

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable | None = None) -> None:
        refuse_closure(closure)
        for optimizer in self.optimizers[1:]:
            copy_hyperparameters(self.user.param_groups, optimizer.param_groups)

        def step_one(i: int) -> None:
            with hooks.replica_phase("optimizer"):
                self.optimizers[i].step()

        run_replicas(self.devices, step_one, generators=False, threads=self.threads)

    def load_state_dict(self, state_dict: dict) -> None:
        for optimizer in self.optimizers:
            optimizer.load_state_dict(copy.deepcopy(state_dict))


# torch.optim's optimizers whose step treats every parameter on its own (state keyed by the parameter,
# nothing computed across parameters): stepping disjoint shards of the parameters does the same arithmetic
# as one step over all of them. LBFGS (one state for all parameters, closures) is not one of them.
PER_PARAMETER = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD", "Adafactor",
) if hasattr(torch.optim, name))


# below this many parameter elements the whole step is a few microsecond-sized kernels: handing shards to
# the replica threads costs more than it saves, and the user's optimizer steps whole on the calling thread
MIN_SHARDED_ELEMENTS = 1 << 20


def balanced_shards(params: Sequence[torch.Tensor], shards: int) -> list[list[int]]:
    """Parameter positions in `shards` groups of about equal element count (largest first to the lightest
    group), each group in position order; groups left empty are dropped."""
    groups: list[list[int]] = [[] for _ in range(shards)]
    load = [0] * shards
    for position in sorted(range(len(params)), key=lambda k: (-params[k].numel(), k)):
        lightest = load.index(min(load))
        groups[lightest].append(position)
        load[lightest] += params[position].numel()
    return [sorted(group) for group in groups if group]


class SharedOptimizer(_UsersOptimizer):
    """replicated on virtual CPU devices: every replica's parameters share replica 0's storage, so the
    user's optimizer steps once per step and every replica sees the result.

    That step runs on all the replica threads at once: the parameters are split into one shard per thread
    (balanced by size), and a shard optimizer (the user's type and hyperparameters over that shard) steps
    each, in the user's optimizer's own state dict, so optimizer.state_dict(), checkpoints and schedulers
    see one ordinary optimizer. Hyperparameters (a scheduler's lr) are copied from the user's groups
    before every step. It is the same arithmetic for the optimizers in PER_PARAMETER; for others, for
    models under MIN_SHARDED_ELEMENTS parameters, or when the user's optimizer has step hooks of its own or
    a replaced step(), the user's optimizer.step() runs whole on the calling thread.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, replica_params: Sequence[Sequence[nn.Parameter]],
                 devices: Sequence[torch.device], threads: int | None):
        self.optimizer = self.user = optimizer
        self.replica_params = [list(params) for params in replica_params]
        self.devices = list(devices)
        self.threads = threads
        self._layout: tuple | None = None  # the param groups the shards were built for
        self._shards: list[tuple[torch.optim.Optimizer, list[int]]] = []  # (shard optimizer, its user group per group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for params in self.replica_params[1:]:
            for p in params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def shardable(self) -> bool:
        """Whether the step may run in shards (see the class doc)."""
        optimizer = self.optimizer
        step = vars(optimizer).get("step")  # an instance attribute: someone replaced step()
        elements = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
        return (len(self.devices) > 1 and elements >= MIN_SHARDED_ELEMENTS and type(optimizer) in PER_PARAMETER
                and not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
                and (step is None or getattr(step, "_wrapped_by_lr_sched", False)))

    def _build_shards(self) -> None:
        groups = self.optimizer.param_groups
        layout = tuple(tuple(id(p) for p in group["params"]) for group in groups)
        if layout == self._layout:
            return
        params = [p for group in groups for p in group["params"]]
        self._shards = []
        for positions in balanced_shards(params, len(self.devices)):
            mine = set(positions)
            shard_groups, user_groups, start = [], [], 0
            for g, group in enumerate(groups):
                chosen = [p for k, p in enumerate(group["params"], start) if k in mine]
                start += len(group["params"])
                if chosen:
                    shard_groups.append({**{key: v for key, v in group.items() if key != "params"}, "params": chosen})
                    user_groups.append(g)
            shard = type(self.optimizer)(shard_groups, **_constructor_defaults(self.optimizer))
            self._shards.append((shard, user_groups))
        self._layout = layout

    def step(self, closure: Callable | None = None) -> None:
        refuse_closure(closure)
        if not self.shardable():
            self.optimizer.step()
            return
        self._build_shards()
        optimizer = self.optimizer
        state, known = optimizer.state, len(optimizer.state)
        for shard, user_groups in self._shards:
            shard.state = state  # the user's entries, whatever load_state_dict put there last
            copy_hyperparameters([optimizer.param_groups[g] for g in user_groups], shard.param_groups)

        def step_shard(k: int) -> None:
            with hooks.replica_phase("optimizer"):
                self._shards[k][0].step()

        run_replicas(self.devices[:len(self._shards)], step_shard, generators=False, threads=self.threads)
        if len(state) != known:  # new entries arrived in thread order: keep the order one step would give
            ordered = collections.defaultdict(dict)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p in state:
                        ordered[p] = state[p]
            ordered.update((key, value) for key, value in state.items() if key not in ordered)
            optimizer.state = ordered
        if getattr(vars(optimizer).get("step"), "_wrapped_by_lr_sched", False):
            optimizer._opt_called = True  # what the scheduler's wrapper of step() records

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)
