"""fsdp: torch's FSDP2 (`fully_shard`), one process per device; parameters, gradients and optimizer state sharded.

Every process keeps 1/N of each parameter (a DTensor shard), of its gradient and of the optimizer's state.
A sharded unit (a block of the model, see `shard_units`) gathers its whole parameters just before its
forward and drops them after it (reshard_after_forward=True, ZeRO-3) or keeps them until its backward
(False, ZeRO-2's memory for parameters during the step); backward gathers them again where they were
dropped and reduce-scatters the gradients, so each process ends the step with its shard of the averaged
gradient and steps its shard of the optimizer. The processes, the data rule and the loss weight that makes
the average the single-device gradient on uneven shares are PerDeviceStrategy's process group's, as under ddp.

On CPU (gloo) it is exact and measurable, but nothing overlaps: FSDP2 prefetches and overlaps its
collectives with CUDA streams. CPU offload of the shards (offload=True) needs CUDA.

Parameters a step leaves without a gradient (a branch not taken, frozen ones) need nothing: FSDP2
reduce-scatters the gradients that exist and leaves a parameter that got none without one, which the optimizer
skips, as on one device. find_unused_parameters is accepted (and changes nothing) so that a script written for
ddp runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.tensor import DTensor

from dpkit.checks import check_int
from dpkit.compilation import CompileFn, compile_forward
from dpkit.observe.collectives import RECORD
from dpkit.parallel import hooks
from dpkit.strategies.base import (
    FOR_THE_STEP,
    ON_ROOT,
    PER_DEVICE,
    PER_UNIT,
    PERSISTENT,
    SHARDED,
    StrategyOptimizer,
    Traits,
)
from dpkit.strategies.mesh import shard_mesh
from dpkit.strategies.named_state import named_optimizer_state, numbered_optimizer_state
from dpkit.strategies.per_device import PerDeviceStrategy
from dpkit.strategies.single import one_device_forward
from dpkit.strategies.step_marks import IN_FIRST_ALL_GATHER
from dpkit.strategies.units import DEFAULT_UNIT_PARAMETERS, innermost_sharded, shard_units

FULL_ON_RANK_0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL_EVERYWHERE = StateDictOptions(full_state_dict=True)


def _holds_tensors(per_parameter: Mapping[Any, Any]) -> bool:
    """Whether an optimizer's per-parameter state holds a tensor of one element or more (moments, buffers)."""
    return any(
        isinstance(value, torch.Tensor) and value.dim() > 0
        for entry in per_parameter.values()
        if isinstance(entry, Mapping)
        for value in entry.values()
    )


def _take_group_keys(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Give the optimizer's param groups the keys the saved groups have and they lack (an LR scheduler's
    `initial_lr`, made before the save and after this load): a plain load_state_dict takes the saved groups whole,
    while torch's distributing load looks every saved key up in the optimizer's own."""
    for group, saved in zip(optimizer.param_groups, state.get("param_groups", [])):
        for key, value in saved.items():
            if key != "params" and key not in group:
                group[key] = value


def _torch_optimizer(optimizer: StrategyOptimizer) -> torch.optim.Optimizer:
    """The optimizer the saving hooks are given: the user's, as FSDP.wrap_optimizer returned it."""
    return cast(torch.optim.Optimizer, optimizer)


# FSDP2's own collectives, announced: the buffer is allocated, and the collective runs, inside the phase of its
# name, so the observer books the buffer by that phase's category and times it (inside forward and backward)


class _AnnouncedAllGather(DefaultAllGather):
    phase = "all_gather"  # what it allocates is gathered parameters

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with hooks.phase(self.phase, self.device):
            return super().allocate(size, dtype=dtype, device=device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with hooks.phase(self.phase, self.device):
            return super().__call__(*args, **kwargs)


class _AnnouncedReduceScatter(DefaultReduceScatter):
    phase = "reduce_scatter"

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with hooks.phase(self.phase, self.device):
            return super().allocate(size, dtype=dtype, device=device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with hooks.phase(self.phase, self.device):
            return super().__call__(*args, **kwargs)


class FSDP(PerDeviceStrategy):
    name = "fsdp"
    # the model's forward and the loss run in this process on its share, as under ddp; only the state is spread
    # weights, gradients and optimizer state sharded over every process (ZeRO-3); each unit gathered for its
    # forward and again for its backward (reshard_after_forward=False: kept from forward to backward)
    traits = Traits(
        processes=PER_DEVICE,
        loss=ON_ROOT,
        replicas=PERSISTENT,
        weights=SHARDED,
        gradients=SHARDED,
        optimizer_state=SHARDED,
        gathers=PER_UNIT,
        grad_scaler=False,
    )
    options = PerDeviceStrategy.options + ("reshard_after_forward", "units", "min_unit_parameters", "offload")
    _compile_fn: CompileFn | None = None  # engine.setup's compile=, applied to the units by wrap_model

    @classmethod
    def traits_for(cls, **options: Any) -> Traits:
        traits = super().traits_for(**options)
        return replace(traits, gathers=FOR_THE_STEP) if options.get("reshard_after_forward") is False else traits

    def __init__(
        self,
        devices: Sequence[torch.device],
        *,
        reshard_after_forward: bool = True,
        units: Callable[[nn.Module], Iterable[nn.Module]] | None = None,
        min_unit_parameters: int = DEFAULT_UNIT_PARAMETERS,
        offload: bool = False,
        precision: str = "32",
        **group_options: Any,
    ):
        # the step marks ride in a step's first all-gather (step_marks.py)
        super().__init__(devices, IN_FIRST_ALL_GATHER, precision=precision, **group_options)
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(
                f"reshard_after_forward: expected True (gather each unit again in backward, least memory) or "
                f"False (keep it gathered from forward to backward), got {reshard_after_forward!r}"
            )
        if units is not None and not callable(units):
            raise TypeError(
                f"units: expected a function model -> the modules to shard as units (innermost first), "
                f"got {type(units).__name__}"
            )
        check_int(min_unit_parameters, "min_unit_parameters", meaning="parameters that make a module a unit")
        if offload and self.device.type != "cuda":
            raise ValueError(
                "offload: CPU offload keeps the shards in host memory between uses, which needs CUDA devices; "
                f"on {self.device.type} the parameters are in host memory already (pass offload=False)"
            )
        self.reshard_after_forward = reshard_after_forward
        self.traits = self.traits_for(reshard_after_forward=reshard_after_forward)
        self.units = units
        self.min_unit_parameters = min_unit_parameters
        self.offload = bool(offload)
        self.model: nn.Module | None = None
        self._sharded_params: dict[int, nn.Parameter] = {}  # id(the user's parameter) -> its sharded successor
        self._told_in_backward: set[int] = set()

    # --- wrapping -----------------------------------------------------------------------------------
    def _mixed_precision(self) -> MixedPrecisionPolicy:
        # compress="bf16"/"fp16": the gradients' reduce-scatter (and hsdp's all-reduce across replicas) in 16 bits
        wire = self.group.options.compression.wire_dtype
        if self.precision == "bf16-mixed":  # bf16 gathers and compute, float32 shards and gradient reduction
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=wire or torch.float32)
        return MixedPrecisionPolicy(reduce_dtype=wire)

    def compile_model(self, model: nn.Module, compile_fn: CompileFn) -> None:
        # compiled by wrap_model, after fully_shard: a module's forward whose units' FSDP2 hooks dynamo does not
        # trace runs eagerly (a graph break; in a loop over the units dynamo gives up on the whole forward), so the
        # innermost sharded modules compile: each unit (torchtitan's way), or the root of a model without units
        self._compile_fn = compile_fn

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if isinstance(model, FSDPModule):
            raise ValueError("model: already sharded with fully_shard; give fsdp the plain model, it shards it")
        model = model.to(self.device)
        before = dict(model.named_parameters())
        units = list(self.units(model)) if self.units is not None else shard_units(model, self.min_unit_parameters)
        shard_size = self.traits.shard_size(self.world_size, per_node=self.local_world_size)
        mesh = shard_mesh(self.device.type, self.world_size, shard_size)
        mp_policy = self._mixed_precision()
        offload_policy = CPUOffloadPolicy() if self.offload else OffloadPolicy()
        for unit in [*(unit for unit in units if unit is not model), model]:
            fully_shard(
                unit,
                mesh=mesh,
                reshard_after_forward=self.reshard_after_forward,
                mp_policy=mp_policy,
                offload_policy=offload_policy,
            )
        if self._compile_fn is not None:  # after fully_shard put its hooks around each (they stay outside the graph)
            for unit in innermost_sharded(model, units):
                compile_forward(unit, self._compile_fn)
        after = dict(model.named_parameters())
        self._sharded_params = {id(before[name]): after[name] for name in before if name in after}
        self.model = self.wrapped = model
        all_gather, reduce_scatter = _AnnouncedAllGather(self.device), _AnnouncedReduceScatter(self.device)
        sharded = [unit for unit in [*units, model] if isinstance(unit, FSDPModule)]  # (all are, since fully_shard)
        for unit in sharded:
            unit.set_custom_all_gather(all_gather)
            unit.set_custom_reduce_scatter(reduce_scatter)
            self._tell_gathered_bytes_around(unit)
        return model

    def _wrapped_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError(f"{self.name}: the model is sharded by engine.setup(model, optimizer); call it first")
        return self.model

    # --- what is gathered: told to listeners (dpkit profile), since no allocation shows it ----------------
    def gathered_bytes(self) -> int:
        """Bytes of whole parameters this process holds now: a unit's parameters are plain tensors (not
        DTensor shards) from its gather until it reshards, in storages FSDP2 resizes in place."""
        storages: dict[int, int] = {}
        for parameter in self._wrapped_model().parameters():
            if not isinstance(parameter, DTensor):
                storage = parameter.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def _tell_gathered_bytes(self, *_: object) -> None:  # (a hook's arguments, not used)
        if not hooks.listening():
            return
        for parameter in self._wrapped_model().parameters():
            if not isinstance(parameter, DTensor) and id(parameter) not in self._told_in_backward:
                # a gathered parameter (FSDP2 keeps the object from step to step): tell the bytes again when its
                # gradient arrives in backward, where its unit is gathered once more
                self._told_in_backward.add(id(parameter))
                parameter.register_post_accumulate_grad_hook(self._tell_gathered_bytes)
        hooks.memory_level(self.device, "gathered_parameters", self.gathered_bytes())

    def _tell_gathered_bytes_around(self, unit: nn.Module) -> None:
        """Tell the gathered bytes on both sides of the unit's own gather (FSDP2's forward pre-hook, registered
        first) and of its reshard (its forward hook, registered last): hooks before and after each."""
        tell = self._tell_gathered_bytes
        unit.register_forward_pre_hook(tell, prepend=True)
        unit.register_forward_pre_hook(tell)
        unit.register_forward_hook(tell, prepend=True)
        unit.register_forward_hook(tell)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the user built on the model's parameters, now holding their shards (fully_shard
        replaces every parameter by a sharded one)."""
        if any(optimizer.state.values()):
            raise ValueError(
                f"optimizer: it already holds state (it has stepped); under strategy '{self.name}' build it on the "
                "model's parameters and pass it to engine.setup before its first step"
            )
        for group in optimizer.param_groups:
            group["params"] = [self._sharded_params.get(id(p), p) for p in group["params"]]
        return optimizer

    def forward_context(self, args: tuple, kwargs: dict) -> AbstractContextManager:
        return one_device_forward(self.model, self.device, args, kwargs)

    # --- the step -----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *, scale: float, sync: bool) -> None:
        # on the micro-batches of an accumulation the gradients stay whole on each process and the units stay
        # gathered; the last one reduce-scatters the sum. `scale` includes this process's loss weight.
        if isinstance(self.model, FSDPModule):  # (once wrapped)
            self.model.set_requires_gradient_sync(sync)
            self.model.set_reshard_after_backward(sync)
        # (includes the gathers and reduce-scatters it waits for)
        with hooks.phase("backward", self.device), RECORD.exchanging_gradients():
            (loss * scale if scale != 1.0 else loss).backward()
        self._tell_gathered_bytes()

    # --- saving and loading: whole states on rank 0, gathered from every process ---------------------
    def model_state(self, model: nn.Module) -> dict[str, Any] | None:
        state = get_model_state_dict(model, options=FULL_ON_RANK_0)
        return state if self.rank == 0 else None

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        set_model_state_dict(model, state, options=FULL_EVERYWHERE)  # each process keeps its shard of it

    def _parameter_names(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """The model's name of each parameter, in the optimizer's numbering (param_groups in order)."""
        names = {id(p): name for name, p in self._wrapped_model().named_parameters()}
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]

    def optimizer_state(self, optimizer: StrategyOptimizer) -> dict[str, Any] | None:
        """The whole optimizer state, numbered as optimizer.state_dict() numbers it, so that any strategy
        can resume it."""
        by_name = get_optimizer_state_dict(self._wrapped_model(), _torch_optimizer(optimizer), options=FULL_ON_RANK_0)
        return numbered_optimizer_state(by_name) if self.rank == 0 else None

    def load_optimizer_state(self, optimizer: StrategyOptimizer, state: dict[str, Any]) -> None:
        torch_optimizer = _torch_optimizer(optimizer)
        _take_group_keys(torch_optimizer, state)
        if not _holds_tensors(state.get("state", {})):
            # plain SGD keeps no per-parameter tensors, and torch's distributing load needs one to learn the
            # device (it asserts): the hyperparameters are the whole state, loaded as they are
            torch_optimizer.load_state_dict({"state": {}, "param_groups": state["param_groups"]})
            return
        by_name = named_optimizer_state(state, self._parameter_names(torch_optimizer))
        set_optimizer_state_dict(self._wrapped_model(), torch_optimizer, by_name, options=FULL_EVERYWHERE)

    # --- saving and loading: each process its shards, through torch.distributed.checkpoint ------------
    def sharded_state(self, model: nn.Module, optimizers: Mapping[str, StrategyOptimizer]) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(model),
            "optimizers": {
                name: get_optimizer_state_dict(model, _torch_optimizer(opt)) for name, opt in optimizers.items()
            },
        }

    def load_sharded_state(
        self, model: nn.Module, optimizers: Mapping[str, StrategyOptimizer], state: dict[str, Any]
    ) -> None:
        set_model_state_dict(model, state["model"])
        for name, optimizer in optimizers.items():
            set_optimizer_state_dict(model, _torch_optimizer(optimizer), state["optimizers"][name])
