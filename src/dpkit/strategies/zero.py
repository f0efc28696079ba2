"""zero: ZeRO stages 1 and 2 (`stage=1|2`), one process per device, from torch's own parts.

- Stage 1 (optimizer state sharded): ddp's DistributedDataParallel all-reduces the gradients, and torch's
  ZeroRedundancyOptimizer steps only the parameters this process owns (whole parameters, dealt out by size,
  largest first, to the process holding the fewest so far), keeping their optimizer state alone, then
  broadcasts each updated parameter from its owner. Weights and gradients stay whole on every process.
- Stage 2 (gradients sharded too): FSDP2's `fully_shard(..., reshard_after_forward=False)`, what torch calls
  ZeRO-2 (FSDP's SHARD_GRAD_OP): backward reduce-scatters the gradients, so each process keeps its shard of
  them and steps its shard of the parameters and of the optimizer's state; the weights are whole from the
  first forward to the end of backward. Its communication is ZeRO-2's (one reduce-scatter and one all-gather of
  the parameters per step, 2Ψ); it gathers the updated weights at the next forward instead of right after the
  step, so between steps it holds their shards only.

Why these are the exact choices: every gradient is the average of the processes' gradients, each process's
loss weighted by its share of the batch (the process shares' rule, as under ddp and fsdp), so it is the
single-device gradient; stage 1 steps each whole parameter with the user's optimizer class on one process and
broadcasts the result, which is the single-device step for any optimizer that treats parameters one by one
(not only elementwise ones: torch partitions whole parameters, never slices); stage 2 steps flat shards, which
equals the whole step for elementwise optimizers (SGD, Adam, AdamW, ...), as under fsdp. A hand-made stage 2
with whole weights and reduce-scattered gradients in plain tensors would leave each process only its part of
the gradients, so clip_grad_norm_ (the user's, or the Engine's) would compute a wrong norm; FSDP2's gradients
are DTensors, whose norm is the whole one.

Saving (engine.save_state): each process writes its shards through torch.distributed.checkpoint, keyed by
parameter names as fsdp's are: stage 1 the optimizer state of the parameters it owns (the weights are whole
and written once), stage 2 its shards of everything; so zero, fsdp and any strategy resume each other's state
on any process count. engine.save / optimizer_state gather the whole state on rank 0.

Parameters a step leaves without a gradient: stage 1 is ddp's model, so it stops with ddp's line unless
find_unused_parameters=True (passed to DDP); stage 2 is FSDP2's, which needs nothing and accepts the option.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.optim import ZeroRedundancyOptimizer

from dpkit.strategies.base import (
    FOR_THE_STEP,
    ON_ROOT,
    PER_DEVICE,
    PERSISTENT,
    SHARDED,
    Strategy,
    StrategyOptimizer,
    Traits,
)
from dpkit.strategies.ddp import DDP
from dpkit.strategies.fsdp import FSDP
from dpkit.strategies.named_state import named_optimizer_state, numbered_optimizer_state
from dpkit.strategies.per_device import PerDeviceStrategy
from dpkit.strategies.replica_optimizers import _constructor_defaults

# what each stage keeps of the weights, gradients and optimizer state (see the docstring above)
STAGE_TRAITS = {
    1: Traits(processes=PER_DEVICE, loss=ON_ROOT, replicas=PERSISTENT, optimizer_state=SHARDED),
    2: Traits(
        processes=PER_DEVICE,
        loss=ON_ROOT,
        replicas=PERSISTENT,
        weights=SHARDED,
        gathers=FOR_THE_STEP,
        gradients=SHARDED,
        optimizer_state=SHARDED,
        grad_scaler=False,
    ),
}


def check_stage(stage: object) -> int:
    if isinstance(stage, bool) or stage not in STAGE_TRAITS:
        raise ValueError(f"stage: expected 1 (optimizer state sharded) or 2 (gradients sharded too), got {stage!r}")
    return 1 if stage == 1 else 2  # (as an int, whichever number type it was given in)


class Zero(PerDeviceStrategy):
    """`zero`, as the registry names it: its options, each stage's traits, and the class create_strategy builds
    for a stage (`built_as`): ZeroStage1 (ddp's model and the sharded optimizer) or ZeroStage2 (fsdp kept
    gathered from forward to backward). Zero itself is a declaration, never built."""

    name = "zero"
    traits = STAGE_TRAITS[1]  # the default stage's
    options = PerDeviceStrategy.options + ("stage",)
    planned_variants = ({"stage": 2},)

    @classmethod
    def traits_for(cls, **options: Any) -> Traits:
        super().traits_for(**options)  # (checks the option names)
        return STAGE_TRAITS[check_stage(options.get("stage", 1))]

    @classmethod
    def built_as(cls, **options: Any) -> type[Strategy]:
        return ZeroStage1 if check_stage(options.get("stage", 1)) == 1 else ZeroStage2

    def __init__(self, devices: Sequence[torch.device], *, stage: int = 1, **group_options: Any):
        # (the signature declares zero's options: the stage and the process group's)
        raise TypeError(
            "zero: built as its stage's class; use create_strategy('zero', devices, stage=...) or "
            "Engine(strategy='zero', stage=...)"
        )


class ShardedOptimizer(ZeroRedundancyOptimizer):
    """torch's ZeroRedundancyOptimizer over the user's optimizer (its class, groups and hyperparameters), as
    the Engine and the observer read an optimizer: `state` is this process's own (its owned parameters'), and
    state_dict() is that share numbered as the whole optimizer numbers it, with no collective (a snapshot
    load_state_dict takes back); whole_state_dict() gathers every share on rank 0 (a collective)."""

    def __init__(self, user: torch.optim.Optimizer):
        # the user's group dicts themselves: a scheduler built on the user's optimizer sets this one's lr
        super().__init__(user.param_groups, optimizer_class=type(user), **_constructor_defaults(user))
        self.user = user  # what the Engine checks a saved optimizer's class against

    @property
    def state(self) -> collections.defaultdict[torch.Tensor, Any]:  # (torch's: anything the optimizer keeps)
        local = self.__dict__.get("optim")
        return local.state if local is not None else self.__dict__.setdefault("_unused_state", {})

    @state.setter  # Optimizer.__init__ sets it before the local optimizer exists
    def state(self, value: collections.defaultdict[torch.Tensor, Any]) -> None:
        self.__dict__["_unused_state"] = value

    def state_dict(self) -> dict[str, Any]:
        return torch.optim.Optimizer.state_dict(self)

    def whole_state_dict(self) -> dict[str, Any] | None:
        self.consolidate_state_dict(to=0)
        if self.rank != 0:
            return None
        whole = ZeroRedundancyOptimizer.state_dict(self)
        self._all_state_dicts: list[dict[str, Any]] = []  # the consolidated copy is not kept between saves
        return whole

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # a replacement: what this process owns and the state does not hold is dropped (a fresh optimizer's)
        params = [param for group in self.param_groups for param in group["params"]]
        given = {id(params[index]) for index in state_dict["state"]}
        for param in [param for param in self.optim.state if id(param) not in given]:
            del self.optim.state[param]
        # torch's load blanks the entries of the parameters other processes own, in the dict it is given
        super().load_state_dict({**state_dict, "state": dict(state_dict["state"])})
        # and makes new group dicts: share the user's again, with the loaded hyperparameters
        for mine, users in zip(self.param_groups, self.user.param_groups):
            users.update({key: value for key, value in mine.items() if key != "params"})
        self.param_groups = self.user.param_groups


def _sharded(optimizer: StrategyOptimizer) -> ShardedOptimizer:
    """The optimizer the saving hooks are given, as ZeroStage1.wrap_optimizer made it."""
    return cast(ShardedOptimizer, optimizer)


class ZeroStage1(DDP):
    """Stage 1: ddp's model, the optimizer's state sharded by ZeroRedundancyOptimizer."""

    name = "zero"
    traits = STAGE_TRAITS[1]
    options = Zero.options

    def __init__(self, devices: Sequence[torch.device], *, stage: int = 1, **group_options: Any):
        super().__init__(devices, **group_options)  # ddp's model, with the process group's options
        self.stage = check_stage(stage)

    def layout(self) -> str:
        return f"{self.name} stage {self.stage}"

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            raise ValueError(
                "optimizer: already a ZeroRedundancyOptimizer; under strategy 'zero' pass the plain optimizer "
                "(e.g. torch.optim.Adam(model.parameters())), it shards its state"
            )
        if any(optimizer.state.values()):
            raise ValueError(
                "optimizer: it already holds state (it has stepped); under strategy 'zero' build it on the model's "
                "parameters and pass it to engine.setup before its first step"
            )
        return ShardedOptimizer(optimizer)

    def optimizer_state(self, optimizer: StrategyOptimizer) -> dict[str, Any] | None:
        return _sharded(optimizer).whole_state_dict()  # every process takes part; rank 0 gets it

    def load_optimizer_state(self, optimizer: StrategyOptimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)  # each process keeps the state of the parameters it owns

    # --- the training state: each process writes the optimizer state it owns (torch.distributed.checkpoint),
    # keyed by parameter names as fsdp's is, so that either resumes the other's, on any process count ---
    def sharded_state(self, model: nn.Module, optimizers: Mapping[str, StrategyOptimizer]) -> dict[str, Any]:
        names = {id(p): name for name, p in model.named_parameters()}
        by_name = {}
        for key, given in optimizers.items():
            optimizer = _sharded(given)
            # a fresh optimizer's state is made (a step at lr 0 with zero gradients) for a load to fill
            _init_optim_state(optimizer.optim)
            order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
            by_name[key] = named_optimizer_state(optimizer.state_dict(), order)
        return {"model": model.state_dict(), "optimizers": by_name}

    def load_sharded_state(
        self, model: nn.Module, optimizers: Mapping[str, StrategyOptimizer], state: dict[str, Any]
    ) -> None:
        model.load_state_dict(state["model"])  # whole, the same in every process
        for key, optimizer in optimizers.items():
            optimizer.load_state_dict(numbered_optimizer_state(state["optimizers"][key]))


class ZeroStage2(FSDP):
    """Stage 2: FSDP2 keeping each unit gathered from its forward to its backward."""

    name = "zero"
    traits = STAGE_TRAITS[2]
    options = Zero.options

    @classmethod
    def traits_for(cls, **options: Any) -> Traits:
        return STAGE_TRAITS[2]  # (FSDP's constructor asks with its reshard_after_forward, which stage 2 sets)

    def __init__(self, devices: Sequence[torch.device], *, stage: int = 2, **group_options: Any):
        super().__init__(devices, reshard_after_forward=False, **group_options)  # with the process group's options
        self.stage = check_stage(stage)

    def layout(self) -> str:
        return f"{self.name} stage {self.stage}"
