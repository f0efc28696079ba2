"""The Engine's wrappers: the model, optimizer, criterion and loader a loop holds, and what a state saves of them.

EngineModule runs the strategy's model under the precision's autocast and keeps the user's module's state
dict keys; EngineOptimizer steps once per accumulation window (Accumulation counts it); EngineCriterion runs
the loss where the strategy runs it; DeviceLoader moves batches to a GPU. Each wrapper can `follow` another
strategy (in-process auto adopting its choice). SetUp is what an Engine set up, as a training state saves
and restores it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpkit.checks import check_number
from dpkit.compilation import has_compiled_forward
from dpkit.engine.resumable_loader import ResumableLoader
from dpkit.engine.run_time_notes import note_own_loss
from dpkit.parallel import hooks
from dpkit.parallel.nested import map_leaves
from dpkit.precision import Precision
from dpkit.strategies import SHARDED, DeferredOutput, Strategy

log = logging.getLogger("dpkit")


class EngineModule(nn.Module):
    """The strategy's model, run under the precision's autocast.

    Its state dict is the user's module's under every strategy, as Lightning Fabric's wrapper gives it:
    state_dict() has the keys (and runs the state-dict hooks) of the module given to engine.setup, so
    `torch.save(model.state_dict(), path)` writes a file the bare module loads; load_state_dict() takes such a
    state dict and loads it into what the strategy trains, every copy of it (see load_state_dict). Under a
    sharded strategy the values are this process's shards (DTensors): engine.save writes the whole model.
    parameters() and named_parameters() are the wrapper's own, as for torch's wrappers (names with `module.`).
    """

    wraps_module = True  # dpkit.unwrap_model / save_model look inside
    loads_every_copy = True  # dpkit.load_model loads through it, so every replica follows
    user_module: nn.Module  # in __dict__ (see __init__)

    def __init__(self, module: nn.Module, precision: Precision, strategy: Strategy, user_module: nn.Module):
        super().__init__()
        self.module = module
        self.precision = precision
        self.strategy = strategy
        # the module given to engine.setup, which the strategy trains (replica 0, DataParallel's or DDP's module, the
        # sharded module); kept out of nn.Module's registry so that its parameters are not listed twice
        self.__dict__["user_module"] = user_module

    def follow(self, strategy: Strategy) -> None:
        """Train the user's module under `strategy` from now on (in-process auto adopting its choice)."""
        self.strategy = strategy
        self.module = strategy.wrap_model(self.user_module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and self.strategy.traits.threads_per_step:
            # torch.compile(the wrapper setup returned), seen while dynamo traces: the replicas run in worker
            # threads, which dynamo does not enter, so they run eager; the per-step code around them is left
            # untraced too (compiling it bought nothing and cost seconds); said once, from outside the graph
            torch.compiler.disable(_say_replicas_run_eager)(self)
            return torch.compiler.disable(self._run)(*args, **kwargs)
        if torch.compiler.is_compiling() and self.strategy.traits.weights == SHARDED:
            # compiled after setup under a sharded strategy: FSDP2's hooks around the root break dynamo's graph and
            # it gives up on the model's forward (measured: no graph, flat or in blocks), so say how to compile it
            torch.compiler.disable(_say_sharded_model_runs_eager)(self)
        output = note_own_loss(self, self._run(*args, **kwargs))  # said once: a loss the model computes itself
        forward_ran = self.__dict__.get("forward_ran")
        if forward_ran is not None:  # the Engine ties the output to the batch in hand (engine/forward_batches.py)
            if torch.compiler.is_compiling():  # (the wrapper compiled after setup: marks are set outside the graph)
                forward_ran = torch.compiler.disable(forward_ran)
            forward_ran(output)
        return output

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """torch DDP's register_comm_hook, on the model engine.setup returned: the strategy runs the hook for every
        gradient bucket (ddp, zero stage 1: dpkit's slot composes it with the collective record); a strategy without
        DDP's buckets refuses it in one line."""
        register = getattr(self.strategy, "register_comm_hook", None)
        if register is None:
            raise ValueError(
                f"register_comm_hook: strategy '{self.strategy.name}' has no DDP gradient buckets to run a "
                "communication hook on; it goes with ddp and zero stage 1 (compress= reaches the other strategies)"
            )
        register(state, hook)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        decide = self.__dict__.get("decide")
        if decide is not None:  # strategy="auto" on several devices: chosen from the first batch
            decide(args, kwargs)
        # the strategy announces its forward through the observation seam (dpkit.parallel.hooks)
        with self.precision.autocast(), self.strategy.forward_context(args, kwargs):
            return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The user's module's state dict: its keys, whatever the strategy wrapped it in."""
        return self.user_module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict keyed as the user's module names them (a bare model's) into what the strategy trains.

        torch's semantics: `strict`, and the result's missing_keys / unexpected_keys, are the user's module's.
        Every copy follows: replicated's other replicas copy the first (also when torch raises after loading the
        keys that matched); under dp and dp-balanced the loaded module is the one replicated at every step; under
        ddp and fsdp each process loads what it is given, so call it in every process with the same state dict.
        Under a sharded strategy whole tensors are cut into this process's shards (its own shards load as they are).
        assign=True is refused: the strategy's replicas, optimizers and gradient exchange hold the parameters set up.
        """
        if assign:
            raise ValueError(
                f"assign: True would make the given tensors the model's parameters, which strategy "
                f"'{self.strategy.name}' does not train (its optimizers, replicas and gradient exchange hold the "
                "parameters engine.setup saw); load with assign=False (a copy into them), or call "
                "load_state_dict(..., assign=True) on the bare model before engine.setup"
            )
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a dict of tensors keyed by name, got {type(state_dict).__name__}")
        if self.strategy.traits.weights == SHARDED:
            state_dict = whole_tensors_as_shards(self.user_module, state_dict)
        try:
            return self.user_module.load_state_dict(state_dict, strict=strict)
        finally:
            # torch copies the keys that match before it raises for the others: the other copies follow either way
            self.strategy.weights_loaded()


def _say_sharded_model_runs_eager(model: EngineModule) -> None:
    """Said once per model: torch.compile of the Engine's wrapper under a sharded strategy compiles none of the model
    (unless its sharded modules were compiled at setup)."""
    if model.__dict__.get("said_eager") or any(has_compiled_forward(m) for m in model.user_module.modules()):
        return
    model.__dict__["said_eager"] = True
    log.warning(
        "torch.compile(model) after engine.setup: under strategy '%s' the model runs eager (FSDP2's hooks around the "
        "sharded model break the graph, and dynamo skips its forward); compile before engine.setup, or pass "
        "Engine(compile=True): either compiles each sharded unit",
        model.strategy.name,
    )


def _say_replicas_run_eager(model: EngineModule) -> None:
    """Said once per model: torch.compile of the Engine's wrapper compiles nothing the replicas run (the strategy
    runs them in its worker threads, which dynamo does not enter)."""
    if model.__dict__.get("said_eager") or has_compiled_forward(model.user_module):
        return
    model.__dict__["said_eager"] = True
    log.warning(
        "torch.compile(model) after engine.setup: under strategy '%s' the replicas run in worker threads, which "
        "this compiles nothing of (they run eager); compile before engine.setup, or pass Engine(compile=True)",
        model.strategy.name,
    )


def whole_tensors_as_shards(model: nn.Module, state: Mapping[str, Any]) -> Mapping[str, Any]:
    """`state` with each whole tensor given for a sharded entry of `model` (a DTensor of the same shape) replaced by
    this process's shard of it, cut locally (no collective: every process holds the whole state, as with a bare
    model). Entries that are shards already, or do not fit, are left for torch's load_state_dict to load or refuse."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # (a sharded model: imported already)

    own = model.state_dict()
    converted = OrderedDict(state)
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        converted._metadata = metadata  # type: ignore[attr-defined]  # versions that modules' loading reads
    for key, value in state.items():
        mine = own.get(key)
        if (
            isinstance(mine, DTensor)
            and isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor)
            and value.shape == mine.shape
        ):
            converted[key] = distribute_tensor(
                value.detach().to(mine.device), mine.device_mesh, mine.placements, src_data_rank=None
            )
    return converted


@dataclass
class Accumulation:
    """Where the loop is in its accumulation window, and how many optimizer steps it took.

    The Engine counts backward calls; the optimizer steps (and zeroes gradients) only at the end of a
    window of `every` of them. Both read this one object.
    """

    every: int
    micro_batches: int = 0  # backward calls in the current window
    stepped: bool = False  # an optimizer already stepped at the end of this window
    steps: int = 0  # optimizer steps taken (windows completed by a step)

    def add_micro_batch(self) -> bool:
        """Count a backward call; True when it completes the window (gradients must be exchanged)."""
        if self.micro_batches >= self.every:
            self.micro_batches, self.stepped = 0, False
        self.micro_batches += 1
        return self.micro_batches == self.every

    def next_syncs(self) -> bool:
        """Whether the next backward will complete its window (a forward before it may prepare the exchange)."""
        done = 0 if self.micro_batches >= self.every else self.micro_batches
        return done + 1 == self.every

    @property
    def complete(self) -> bool:
        return self.micro_batches >= self.every

    @property
    def at_boundary(self) -> bool:
        """Between windows: nothing accumulated that a step has not consumed."""
        return self.micro_batches == 0 or (self.complete and self.stepped)

    def count_step(self) -> None:
        if not self.stepped:
            self.stepped = True
            self.steps += 1


class EngineOptimizer(torch.optim.Optimizer):
    """The strategy's optimizer; step and zero_grad act once per `accumulate` backward calls.

    An instance of torch.optim.Optimizer (torch's LR schedulers and anything else that checks for one take it)
    that holds no state of its own: param_groups, state and defaults are the strategy's optimizer's, whose
    hyperparameters the user's optimizer gives (a scheduler made on either changes the same learning rates)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accumulation: Accumulation,
        precision: Precision,
        given: torch.optim.Optimizer | None = None,
    ):  # torch.optim.Optimizer.__init__ is not called: there is nothing of its own to hold
        self.optimizer = optimizer
        self.accumulation = accumulation
        self.precision = precision
        self.given = optimizer if given is None else given  # as given to engine.setup, before the strategy's wrapping

    def follow(self, strategy: Strategy) -> None:
        """Step under `strategy` from now on (in-process auto adopting its choice)."""
        self.optimizer = strategy.wrap_optimizer(self.given)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:  # per parameter, whatever its optimizer keeps
        return self.optimizer.state

    @state.setter
    def state(self, state: defaultdict[torch.Tensor, Any]) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.accumulation.micro_batches == 0 or self.accumulation.complete:  # not in the middle of a window
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if self.accumulation.micro_batches == 0:
            # a plain loss.backward() bypasses the Engine's count: stepping silently never would be worse
            raise RuntimeError(
                "optimizer.step(): no engine.backward(loss) since the last step; in an Engine loop call "
                "engine.backward(loss) instead of loss.backward() (it weights, accumulates and exchanges the gradients)"
            )
        if not self.accumulation.complete:
            return None  # still accumulating micro-batches
        self.accumulation.count_step()
        if closure is not None:
            return self.optimizer.step(closure)
        return self.precision.step(self.optimizer)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:  # the strategy's optimizer's other attributes (its hooks, …)
        if name in ("optimizer", "accumulation", "precision", "given"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"EngineOptimizer({self.optimizer!r})"


class EngineCriterion:
    """The criterion engine.setup_criterion returns: under a strategy that runs the loss in its replicas
    (dp-balanced, replicated) the strategy's; elsewhere the user's, announced as the "loss" phase."""

    def __init__(self, criterion: Callable, strategy: Strategy, precision: Precision):
        self.criterion, self.precision = criterion, precision
        self.follow(strategy)

    def follow(self, strategy: Strategy) -> None:
        """Compute the loss as `strategy` does from now on (in-process auto adopting its choice)."""
        self.in_replicas = strategy.wrap_criterion(self.criterion)
        self.device = strategy.root_device

    def __call__(self, output: Any, *targets: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(output, DeferredOutput):  # the replicas announce their own loss phases
            with self.precision.autocast():
                return self.in_replicas(output, *targets, **kwargs)
        with hooks.phase("loss", self.device):
            return self.criterion(output, *targets, **kwargs)


def clip_gradients(
    strategy: Strategy,
    model: nn.Module,
    optimizer: EngineOptimizer,
    precision: Precision,
    max_norm: float,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """engine.clip_gradients: clip_grad_norm_ over the gradients `optimizer`'s next step applies, whatever holds
    them (16-mixed unscales first; replicas that step themselves are clipped by the same factor)."""
    check_number(max_norm, "max_norm", positive=True)
    unscaled = precision.unscale(optimizer.optimizer)
    first, *others = strategy.gradient_holders(model)
    norm = torch.nn.utils.clip_grad_norm_(first, max_norm, norm_type=norm_type)
    if others:
        factor = unscaled * min(1.0, max_norm / (float(norm) + 1e-6))
        with torch.no_grad():
            for params in others:
                for param in params:
                    if param.grad is not None:
                        param.grad.mul_(factor)
    return norm


class DeviceLoader:
    """Moves every tensor of every batch to the device (GPUs; a no-op wrapper is never made for CPU)."""

    def __init__(self, loader: Iterable, device: torch.device):
        self.loader, self.device = loader, device

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield map_leaves(
                lambda _, x: x.to(self.device, non_blocking=True) if isinstance(x, torch.Tensor) else x, batch, "batch"
            )

    def __len__(self) -> int:
        if not isinstance(self.loader, Sized):  # as len() itself says
            raise TypeError(f"object of type {type(self.loader).__name__!r} has no len()")
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


@dataclass
class SetUp:
    """What an Engine set up, as a training state saves and restores it (engine/resume/save.py, state_load.py)."""

    model: nn.Module  # the bare model: the innermost module given to engine.setup
    optimizers: list[EngineOptimizer]
    loaders: list[ResumableLoader]  # in setup order; their positions are part of the state
    accumulation: Accumulation
    strategy: Strategy
    precision: Precision
    devices: list[torch.device] = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.accumulation.steps

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.rank == 0
