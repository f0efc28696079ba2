"""What a strategy is (its traits) and what it does (the hooks the Engine calls), with one-device defaults.

A strategy decides how devices cooperate in one step: how the model and optimizer are wrapped, which part
of the global batch this process sees and how much its loss weighs, how backward turns into one gradient
equal to a single-device step, how values are reduced across processes, how its state is saved and loaded,
and whether it needs a launcher. The base class is the one-process, one-device behaviour; a strategy
declares its `traits` and overrides only the hooks where it differs.

Everything outside strategies/ asks the registry (strategies/__init__.py) and these traits, never a name:
the Engine, `dpkit train` / `profile` / `bench`, and the planner, whose cost model composes a strategy's
time and memory from its traits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, TypeVar

import torch
from torch import nn

from dpkit.compilation import CompileFn, compile_forward
from dpkit.launch.environment import launched

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

# Traits.processes
ONE_PROCESS = "one"  # one process drives every device of its node (threads, one per device)
PER_DEVICE = "per-device"  # one process per device, started by a launcher; spans nodes
# Traits.loss
ON_ROOT = "root"  # on the first device, on the whole batch's outputs (gathered, or the one device's)
IN_REPLICAS = "replicas"  # inside each replica on its rows; the step's loss is their row-weighted mean
# Traits.replicas
NO_REPLICAS = "none"  # the model on its one device
PER_STEP = "per-step"  # copied from the first device at every forward; gradients summed back into it
PERSISTENT = "persistent"  # kept between steps; every replica gets the summed gradient and steps itself
# Traits.weights, .gradients, .optimizer_state: what one process keeps of each part of the training state
WHOLE = "whole"  # all of it, on every process (or replica)
SHARDED = "sharded"  # 1/S of it on each of the S processes of its shard group (Traits.shard_group)
# Traits.gathers: how sharded weights become whole for the computation
NO_GATHER = "none"  # the weights are whole already (or nothing is sharded)
PER_UNIT = "per-unit"  # a unit at a time, dropped after its forward and gathered again in backward (ZeRO-3, fsdp)
FOR_THE_STEP = "step"  # unit by unit in forward and kept until backward: the whole model gathered at the peak
# Traits.shard_group: the processes a shard spans; the state is replicated across the groups (an int: that many)
ALL_PROCESSES = "all"  # every process of the run, across nodes
ONE_NODE = "node"  # the processes of one node (hybrid sharding: shard within a node, replicate across nodes)


class SaveCollectives(NamedTuple):
    """What the processes of a save written in the background agree through: a barrier, an all_gather_object, and
    the process group torch.distributed.checkpoint writes shards over (None in one process)."""

    barrier: Callable[[], None]
    gather: Callable[[Any], list[Any]]
    group: Any


@dataclass(frozen=True)
class Traits:
    """What a strategy is, as data.

    processes: ONE_PROCESS or PER_DEVICE (see above).
    loss: where the loss runs, ON_ROOT or IN_REPLICAS.
    replicas: NO_REPLICAS, PER_STEP or PERSISTENT.
    max_devices: the most devices it can use (1 for the one-device reference), None for any number.
    weights, gradients, optimizer_state: WHOLE or SHARDED, what one process keeps of each between steps
        (gradients: after backward's exchange, all-reduced whole or reduce-scattered to the shard)
        (ZeRO stage 1 shards the optimizer state, stage 2 the gradients too, stage 3 / fsdp the weights too).
    gathers: how SHARDED weights are made whole to compute, PER_UNIT or FOR_THE_STEP (NO_GATHER when whole).
    shard_group: the processes a SHARDED part is split over: ALL_PROCESSES, ONE_NODE or a number of processes;
        the groups replicate each other (hsdp: a mesh of replicate x shard). Ignored when nothing is sharded.
    sharded (derived): some part is SHARDED, so saving and loading are collective (each process its shards).
    balances: rows per device follow measured memory, after a few calibration steps.
    shares_host_weights: on virtual CPU devices, which share one memory, the replicas are views of one
        copy of the weights with one optimizer state.
    grad_scaler: works with precision '16-mixed' (a GradScaler).
    """

    processes: str
    loss: str
    replicas: str
    max_devices: int | None = None
    weights: str = WHOLE
    gradients: str = WHOLE
    optimizer_state: str = WHOLE
    gathers: str = NO_GATHER
    shard_group: int | str = ALL_PROCESSES
    balances: bool = False
    shares_host_weights: bool = False
    grad_scaler: bool = True
    # optimizer steps between the replicas' meetings: 1 for every strategy that exchanges gradients each step;
    # localsgd and diloco train each replica alone and average every `sync_every` steps (auto never picks them:
    # they change the optimization)
    sync_every: int = 1

    def __post_init__(self) -> None:
        for part in ("weights", "gradients", "optimizer_state"):
            if getattr(self, part) not in (WHOLE, SHARDED):
                raise ValueError(f"{part}: expected {WHOLE!r} or {SHARDED!r}, got {getattr(self, part)!r}")
        if self.gathers not in (NO_GATHER, PER_UNIT, FOR_THE_STEP):
            raise ValueError(f"gathers: expected {NO_GATHER!r}, {PER_UNIT!r} or {FOR_THE_STEP!r}, got {self.gathers!r}")
        if (self.weights == SHARDED) != (self.gathers != NO_GATHER):
            raise ValueError(
                f"gathers: sharded weights are gathered ({PER_UNIT!r} or {FOR_THE_STEP!r}) and whole ones are not "
                f"({NO_GATHER!r}); got weights={self.weights!r}, gathers={self.gathers!r}"
            )
        group = self.shard_group
        if group not in (ALL_PROCESSES, ONE_NODE) and (
            isinstance(group, bool) or not isinstance(group, int) or group < 1
        ):
            raise ValueError(
                f"shard_group: expected {ALL_PROCESSES!r}, {ONE_NODE!r} or a positive number of processes, "
                f"got {group!r}"
            )

    @property
    def sharded_parts(self) -> tuple[str, ...]:
        """The parts of the training state split over a shard group, of weights, gradients, optimizer_state."""
        return tuple(part for part in ("weights", "gradients", "optimizer_state") if getattr(self, part) == SHARDED)

    @property
    def sharded(self) -> bool:
        """Some part of the state is split across processes: saving and loading are collective."""
        return bool(self.sharded_parts)

    def shard_size(self, processes: int, per_node: int) -> int:
        """The processes one shard group spans, in a run of `processes` with `per_node` on each node (1 when
        nothing is sharded)."""
        if not self.sharded:
            return 1
        if self.shard_group == ALL_PROCESSES:
            return processes
        if self.shard_group == ONE_NODE:
            return min(per_node, processes)
        return min(int(self.shard_group), processes)

    @property
    def compressions(self) -> tuple[str, ...]:
        """The gradient compressions (strategies/compression.py) this strategy's exchange can take: every kind where
        whole gradients are all-reduced among persistent replicas, the 16-bit ones where gradients are
        reduce-scattered to shards, none where nothing crosses between persistent replicas (one device; a model
        re-replicated each step, whose gradients torch's autograd sums onto the first device)."""
        if self.replicas != PERSISTENT:
            return ("none",)
        if self.gradients == SHARDED:
            return ("none", "bf16", "fp16")
        return ("none", "bf16", "fp16", "powersgd")

    @property
    def threads_per_step(self) -> bool:
        """Several replicas in one process, each run by its device's worker thread."""
        return self.processes == ONE_PROCESS and self.replicas != NO_REPLICAS

    @property
    def one_device_per_process(self) -> bool:
        return self.processes == PER_DEVICE or self.max_devices == 1


T = TypeVar("T")


class StrategyOptimizer(Protocol):
    """What the saving hooks (optimizer_state, sharded_state, ...) are given: the optimizer the strategy's
    wrap_optimizer returned, the user's torch optimizer or an optimizer-like object over it (replicated's
    ReplicaOptimizers and SharedOptimizer); the base hooks use its state dict only."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


def criterion_sums(criterion: Callable) -> bool:
    """Whether a criterion adds its rows' losses (torch's losses with reduction="sum"): the replicas' losses of
    such a criterion are added, not averaged by rows, in value and gradient (pair it with
    engine.backward(loss, items=n))."""
    return getattr(criterion, "reduction", None) == "sum"


class Strategy:
    """The one-process, one-device behaviour every strategy starts from."""

    name: ClassVar[str] = "single"
    # the class's traits, with its default options; a strategy whose options change them (zero's stage, hsdp's
    # shard_size) overrides traits_for and sets self.traits = self.traits_for(...) in its constructor
    traits: Traits = Traits(processes=ONE_PROCESS, loss=ON_ROOT, replicas=NO_REPLICAS, max_devices=1)
    # keyword options the constructor takes besides the devices (Engine(**strategy_options) passes them)
    options: ClassVar[tuple[str, ...]] = ()
    # option sets the planner shows besides the defaults (`dpkit plan --strategies`), e.g. ({"stage": 1},)
    planned_variants: ClassVar[tuple[Mapping[str, Any], ...]] = ()
    # one process: rank 0 of 1; strategies with a process per device set these from the launcher's environment
    rank = 0
    world_size = 1

    def __init__(self, devices: Sequence[torch.device], *, precision: str = "32"):
        self.devices = list(devices)
        # the run's precision ("32", "bf16-mixed", "16-mixed"), given at construction; the Engine applies it
        # (autocast, GradScaler), and a strategy that also applies it itself (fsdp's gathers in bf16) reads it
        self.precision = precision
        most = self.traits.max_devices
        if most is not None and len(self.devices) > most:
            raise ValueError(
                f"devices: strategy '{self.name}' uses {most} device{'s' if most > 1 else ''}, "
                f"got {len(self.devices)}; "
                f"pass devices={most} or choose a strategy for several devices"
            )
        self.criterion: Callable | None = None  # set by loss-in-replicas strategies

    @classmethod
    def traits_for(cls, **options: Any) -> Traits:
        """The traits of an instance built with `options` (the planner predicts from them without building
        one); the class's own unless an option changes what is sharded or over which group."""
        unknown = sorted(set(options) - set(cls.options))
        if unknown:
            accepted = ", ".join(cls.options) or "none"
            raise TypeError(f"{unknown[0]}: not an option of strategy '{cls.name}' (its options: {accepted})")
        return cls.traits

    @classmethod
    def built_as(cls, **options: Any) -> type[Strategy]:
        """The class create_strategy builds for `options`: this one, unless an option picks another composition
        (zero's stage: ddp's model with a sharded optimizer, or fsdp kept gathered)."""
        return cls

    # --- launching ----------------------------------------------------------------------------------
    @classmethod
    def needs_launcher(cls) -> bool:
        """Whether this process must start the strategy's processes first (one per device, not launched yet)."""
        return cls.traits.processes == PER_DEVICE and not launched()

    @classmethod
    def profile_options(cls) -> dict[str, Any]:
        """Options under which the strategy holds on virtual CPU devices what it holds on GPUs: what
        `dpkit profile` measures, so its per-device memory means the same on either."""
        return {}

    def layout(self) -> str:
        """The strategy as a run's start line and `dpkit ckpt inspect` name it, with what its options chose
        (zero's stage, hsdp's mesh)."""
        return self.name

    @property
    def root_device(self) -> torch.device:
        """Where this process keeps the model and puts the batches it receives."""
        return self.devices[0]

    def setup_environment(self) -> None:
        """Prepare the process (threads, process group) before any model is wrapped."""

    # --- wrapping -----------------------------------------------------------------------------------
    def compile_model(self, model: nn.Module, compile_fn: CompileFn) -> None:
        """Compile `model` (bare) with `compile_fn` (torch.compile and the user's options); engine.setup calls it
        before wrap_model. Here: the class forward compiled once and bound on the model; the replicas that dp,
        dp-balanced and replicated make from it rebind it to themselves, so each runs the compiled code."""
        compile_forward(model, compile_fn)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model.to(self.root_device)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        # (Any: a StrategyOptimizer, which the Engine's EngineOptimizer holds as a torch optimizer)
        return optimizer

    def wrap_criterion(self, criterion: Callable) -> Callable:
        """Strategies that compute the loss inside replicas return a callable taking a DeferredOutput."""
        return criterion

    def model_copies(self, model: nn.Module) -> list[tuple[nn.Module, torch.device]]:
        """(module, device) for every copy of the model this process keeps between steps; `model` is the
        user's model as set up."""
        return [(model, self.root_device)]

    # --- the data -----------------------------------------------------------------------------------
    def gradient_holders(self, model: nn.Module) -> list[list[torch.Tensor]]:
        """The parameters whose gradients the next optimizer step applies: one list (the first is the one whose
        norm counts), or one per replica that steps itself; clipping scales every list alike."""
        return [list(model.parameters())]

    def global_batches(self, loader: DataLoader) -> Iterable[list[int]] | None:
        """The batch sampler whose batches of indices are the global batches (`loader` is a torch DataLoader
        over a map-style dataset with batches)."""
        return loader.batch_sampler

    def batch_share(self, indices: list[int]) -> list[int]:
        """The indices of one global batch this process loads; one process loads the whole batch."""
        return indices

    def loss_weight(self, rows: int, global_rows: int) -> float:
        """What this process's mean loss over its `rows` of a global batch of `global_rows` is scaled by,
        so that the gradient exchange yields the whole batch's mean (1 when one process sees it all)."""
        return 1.0

    def sum_weight(self) -> float:
        """What a loss that is a sum over this process's items is scaled by, so that the gradient exchange
        yields the sum over every process (the exchange averages over the processes: their number)."""
        return float(self.world_size)

    def loss_is_sum(self) -> None:
        """The next backward's loss is a sum over items, not a mean (engine.backward(loss, items=n)): a
        strategy that combined its replicas' losses as a row-weighted mean adds them instead."""

    # --- the step -----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *, scale: float, sync: bool) -> None:
        """Gradients of `loss * scale`; `sync` is False on the micro-batches of an accumulation."""
        (loss * scale if scale != 1.0 else loss).backward()

    @staticmethod
    def next_backward_syncs() -> bool:
        """Whether the backward after the next forward ends its accumulation window (the Engine replaces this with
        its window's answer); ddp's forward leaves the gradient exchange unprepared when it will not."""
        return True

    def forward_context(self, args: tuple, kwargs: dict) -> AbstractContextManager:
        """Entered around the model's forward in the user's loop. Strategies whose forward announces its
        own phases through dpkit.parallel.hooks (DataParallel's scatter/forward/gather) leave it empty."""
        return contextlib.nullcontext()

    # --- saving and loading (every process calls these; collective where the state is spread) ------
    def model_state(self, model: nn.Module) -> dict[str, Any] | None:
        """The whole model's state dict for saving, keyed as the bare `model` names it, on rank 0
        (None on the other ranks)."""
        return model.state_dict() if self.rank == 0 else None

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Load a whole (checked) state dict into the bare `model`, and into every copy of it."""
        model.load_state_dict(state, strict=True)
        self.weights_loaded()

    def optimizer_state(self, optimizer: StrategyOptimizer) -> dict[str, Any] | None:
        """The optimizer's whole state dict for saving, on rank 0 (None on the other ranks)."""
        return optimizer.state_dict() if self.rank == 0 else None

    def load_optimizer_state(self, optimizer: StrategyOptimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def sharded_state(self, model: nn.Module, optimizers: Mapping[str, StrategyOptimizer]) -> dict[str, Any] | None:
        """This process's shards of the model ("model") and of the optimizers given by name ("optimizers":
        {name: …}), which save_state writes through torch.distributed.checkpoint; None (the default): the
        state is saved whole, from model_state and optimizer_state. A `sharded` strategy returns the shards."""
        return None

    def load_sharded_state(
        self, model: nn.Module, optimizers: Mapping[str, StrategyOptimizer], state: dict[str, Any]
    ) -> None:
        """Apply what sharded_state returned, filled from a saved state (same keys, this process's layout)."""
        raise NotImplementedError(f"strategy '{self.name}' saves whole states; it has no sharded state to load")

    def weights_loaded(self) -> None:
        """The user's model just received new weights; copies elsewhere must follow."""

    def state_dict(self) -> dict[str, Any]:
        """What the strategy learned that decides its arithmetic (dp-balanced: its chunk sizes), for a resumed
        run under the same strategy and device count; empty when there is nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned."""

    def items_in_step(self, items: float) -> float:
        """The items a step's gradient divides by, given this process's: summed over the processes whose gradients
        the step combines (every one; localsgd and diloco: this replica's own)."""
        return float(self.all_reduce(torch.tensor(items, dtype=torch.float64), "sum"))

    def rows_trained(self, rows: int) -> None:
        """The Engine's backward of a batch of `rows` rows of this process (localsgd and diloco weight their
        meetings by them)."""

    def run_metrics(self) -> dict[str, Any]:
        """What a run's metrics.json records of the strategy (localsgd, diloco: the replicas' spread at each
        meeting); empty when nothing."""
        return {}

    def background_collectives(self) -> SaveCollectives:
        """The collectives of a save written in the background, apart from the training's own; in one process
        there is nobody to agree with."""
        return SaveCollectives(lambda: None, lambda value: [value], None)

    def process_state(self) -> dict[str, Any] | None:
        """What this process's strategy keeps of its own between steps, saved in its rank-R.pt (the compressed
        exchange's error feedback and factors); None when nothing."""
        return None

    def load_process_state(self, state: dict[str, Any]) -> str | None:
        """Restore what process_state() returned (under the same strategy and process count); a note when it
        cannot be carried (saved under another compression), None when it was."""
        return None

    # --- across processes: identities in one process -------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj: T) -> list[T]:
        """Every process's `obj` (picklable), in rank order."""
        return [obj]

    def barrier(self) -> None:
        pass

    def teardown(self) -> None:
        pass

    def concurrency_choice(self) -> dict[str, str]:
        """What this strategy's auto call sites decided about running their replicas (parallel/concurrency.py):
        a plain value the Engine records in a run's state. None here: no replica call sites."""
        return {}

    def set_concurrency(self, concurrency: str | Mapping[str, str]) -> None:
        """Run the replica call sites as declared, or as a saved run decided (what concurrency_choice() gave)."""


_UNRUN = object()  # a DeferredOutput whose forward has not run on its own


@dataclass
class DeferredOutput:
    """What `model(x)` returns while training under a loss-in-replicas strategy (dp-balanced, replicated).

    The forward has not run yet: it runs in each replica, on its slice of the batch, together with the
    loss, when the criterion from `engine.setup_criterion(...)` receives this object and the targets.
    Used as what the model returns instead (`out["loss"]`, `out.loss`, `out.logits`, `out[0]`, iteration:
    a model that computes its own loss), it runs the forward through `run`, once, and behaves as its
    gathered output, whose 0-dim losses are the row-weighted mean of the replicas'.
    """

    strategy_name: str
    args: tuple
    kwargs: dict
    run: Callable[[], Any] | None = None
    _output: Any = _UNRUN

    def output(self) -> Any:
        """The model's output (the forward run once, gathered)."""
        if self._output is _UNRUN:
            if self.run is None:
                raise AttributeError(
                    f"model(x) under strategy '{self.strategy_name}' returns a deferred output: the forward runs "
                    "inside the replicas together with the loss. Pass it to the criterion returned by "
                    "engine.setup_criterion(criterion); for plain outputs call model.eval() or use torch.no_grad()"
                )
            self._output = self.run()
        return self._output

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # copy, pickle and dataclass probes: not the output's
            raise AttributeError(name)
        return getattr(self.output(), name)

    def __getitem__(self, key: object) -> Any:
        return self.output()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.output())

    def __len__(self) -> int:
        return len(self.output())

    def __contains__(self, key: object) -> bool:
        return key in self.output()

    def keys(self) -> Any:
        return self.output().keys()

    def __repr__(self) -> str:
        return f"DeferredOutput(strategy={self.strategy_name!r}, {len(self.args)} args, kwargs={sorted(self.kwargs)})"


def defers(strategy: Strategy, module: nn.Module) -> bool:
    """Whether a forward should be deferred to the criterion: training, with grad, criterion set up."""
    return strategy.criterion is not None and module.training and torch.is_grad_enabled()
