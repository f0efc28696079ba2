"""A module's methods run in dpkit's replicas with one device's results: the part the Trainer's and Fabric's
strategies share.

`StepReplicas(module, mode, devices)` wraps a module (a LightningModule, or any module under Fabric). Its
`run(method, args, kwargs)` splits the arguments along dim 0, runs `module.<method>` (training_step,
validation_step, test_step, predict_step, or forward) in one replica per device, and returns what one device
running the whole batch would have returned:

- training_step's loss is the replicas' losses weighted by their rows (dpkit's loss-in-replicas path:
  DataParallel's loss_fn for the per-step modes, the persistent replicas' combined loss for `replicated`),
  so backward gives one device's gradients on even and uneven splits; other values it returns are combined
  as `combine_outputs` says;
- the replicas' `self.log` calls are recorded and logged once on the calling thread (logs.py);
- on virtual CPU devices the replicas draw their random numbers (dropout) as one device would
  (dpkit.parallel.whole_batch_rng), and torch's default generator ends where one device leaves it;
- persistent replicas (`replicated`) first receive the module's training flags and plain attributes, which
  Lightning and the user's hooks set on the module between steps.

Arguments with no tensor to split run once, unreplicated, on the first device.

Which dpkit strategy does what is asked of the registry's traits, never of a name: per-step replicas are a
dpkit.DataParallel (balanced when the strategy balances), persistent ones the strategy object itself.

The parts: what the strategies accept (arguments.py), what each replica runs (replica_step.py), how the
replicas' outputs become one device's (outputs.py), and Fabric's forward (fabric_forward.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from dpkit.devices import DeviceLike, parse_device_list
from dpkit.integrations.lightning.arguments import check_mode, check_options
from dpkit.integrations.lightning.fabric_forward import DeferredForward, redirected_method
from dpkit.integrations.lightning.logs import replay
from dpkit.integrations.lightning.outputs import combine_outputs, training_output
from dpkit.integrations.lightning.replica_step import (
    CALL_KEYWORD,
    RETURNS_LOSS,
    RETURNS_NOTHING,
    RETURNS_OUTPUT,
    ROWS_KEYWORD,
    TRAINING_STEP,
    ReplicaResult,
    ReplicaStep,
    StepCall,
    call_method,
)
from dpkit.parallel import DataParallel
from dpkit.parallel.reduce import GradientSum
from dpkit.parallel.scatter import batch_size_of
from dpkit.parallel.whole_batch_rng import finish_draws
from dpkit.strategies import PERSISTENT, DeferredOutput, create_strategy, strategy_class

log = logging.getLogger("dpkit")

_MODULE_KEYS = frozenset(nn.Module().__dict__) | {"_device", "_dtype", "log", "log_dict"}


class PersistentOptimizer(Protocol):
    """What StepReplicas uses of the optimizer a persistent strategy's wrap_optimizer returns (replicated's
    ReplicaOptimizers or SharedOptimizer): it steps every replica, over the user's optimizer."""

    user: torch.optim.Optimizer

    def step(self) -> None: ...
    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


@runtime_checkable
class PersistentReplicas(Protocol):
    """What StepReplicas uses of a one-process strategy whose replicas persist (the registry's `replicated`)."""

    replicas: list[nn.Module]
    params: list[list[nn.Parameter]]
    gradients: GradientSum | None

    def wrap_model(self, model: nn.Module) -> nn.Module: ...
    def forward(self, args: tuple, kwargs: dict) -> Any: ...
    def forward_loss(
        self, output: DeferredOutput, criterion: Callable, targets: tuple, criterion_kwargs: dict
    ) -> torch.Tensor: ...
    def reduce_gradients(self) -> None: ...
    def gradient_sync(self, sync: bool) -> AbstractContextManager[None]: ...
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> PersistentOptimizer: ...
    def weights_loaded(self) -> None: ...


class StepReplicas(nn.Module):
    """The module and its replicas on `devices` under dpkit strategy `mode`; see the module doc.

    state_dict keys carry a `module.` prefix (dpkit.save_model and the strategies' state hooks strip it)."""

    wraps_module = True  # dpkit.unwrap_model / save_model / load_model look inside
    # set with object.__setattr__ (not registered: they hold the module again, whose keys would repeat)
    step: ReplicaStep
    persistent: PersistentReplicas | None
    data_parallel: DataParallel | None
    steppers: dict[int, PersistentOptimizer]  # id(user's optimizer) -> the persistent strategy's optimizer

    def __init__(self, module: nn.Module, mode: str, devices: Sequence[DeviceLike], **options: Any):
        super().__init__()
        self.module = module
        traits = strategy_class(check_mode(mode), argument="mode").traits
        self.mode = mode
        self.devices = parse_device_list(devices, argument="devices")
        self.on_cpu = all(device.type == "cpu" for device in self.devices)
        step = ReplicaStep(module)
        persistent: PersistentReplicas | None = None
        data_parallel: DataParallel | None = None
        if traits.replicas == PERSISTENT:
            strategy = create_strategy(mode, self.devices, **check_options(mode, options))
            if not isinstance(strategy, PersistentReplicas):  # (check_mode: one-process modes only)
                raise TypeError(f"mode: {mode!r} keeps persistent replicas, but not in one process as this runs them")
            strategy.wrap_model(step)
            persistent = strategy
        else:
            check_options(mode, options)
            balance = "memory" if traits.balances else None
            data_parallel = DataParallel(step, self.devices, loss_fn=self._replica_loss, balance=balance)
        # not registered: they hold the module again, whose keys would repeat
        object.__setattr__(self, "step", step)
        object.__setattr__(self, "persistent", persistent)
        object.__setattr__(self, "data_parallel", data_parallel)
        object.__setattr__(self, "steppers", {})  # id(user's optimizer) -> the persistent strategy's optimizer
        self._criterion: Callable | None = None
        self._draws: dict[tuple[str, bool], bool] = {}  # (method, training) -> whether its replicas draw
        self._warned: set[str] = set()
        self.sum_after_backward = False  # the last call with grad gave outputs, not the replicas' combined loss
        self.summing = True  # False inside no_sum(): backwards leave each replica its own gradient
        self.defers = False  # training forwards wait for a criterion (Fabric's setup_criterion)

    @property
    def root_device(self) -> torch.device:
        return self.devices[0]

    # --- the calls ------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        method = redirected_method(self.module)
        if method is not None:
            return self.run(method, args, kwargs)
        if self.defers and self.module.training and torch.is_grad_enabled():
            return DeferredForward(self, args, kwargs)
        return self.run("forward", args, kwargs)

    def run(
        self,
        method: str,
        args: tuple,
        kwargs: dict,
        *,
        criterion: Callable | None = None,
        targets: tuple = (),
    ) -> Any:
        """`module.<method>(*args, **kwargs)` over the replicas, combined as one device's result; with a
        criterion, `criterion(module(*args, **kwargs), *targets)` computed in each replica, combined by rows."""
        module = self.module
        total = batch_size_of((args, targets), kwargs, 0)
        training = module.training and torch.is_grad_enabled()
        if criterion is not None:
            returns = RETURNS_OUTPUT
        elif method == TRAINING_STEP and training:
            returns = RETURNS_LOSS
        else:
            returns = RETURNS_OUTPUT if method == "forward" else RETURNS_NOTHING
        with_loss = returns == RETURNS_LOSS or criterion is not None
        if torch.is_grad_enabled():
            # a loss that does not come from the replicas' losses reaches their gradients on this thread (or
            # only the first replica's): the sum then follows the backward (see after_backward)
            self.sum_after_backward = total is None or not with_loss
        if total is None:  # nothing to split
            return self._run_here(method, args, kwargs, criterion, targets)
        key = (method, bool(module.training))
        state = torch.default_generator.get_state() if self.on_cpu and len(self.devices) > 1 else None
        protect = state is not None and self._draws.get(key) is not False
        call = StepCall(method, total, returns, state if protect else None)
        rows = torch.arange(total, device=self.root_device)
        extra = {**kwargs, CALL_KEYWORD: call, ROWS_KEYWORD: rows}
        self._prepare_replicas()
        self._criterion = criterion
        try:
            if self.persistent is not None:
                if with_loss:
                    target = ((rows, tuple(targets)),)
                    value = self.persistent.forward_loss(
                        DeferredOutput(self.mode, args, extra), self._replica_loss, target, {}
                    )
                else:
                    value = self.persistent.forward(args, extra)
            elif with_loss:
                value = self._per_step()(*args, target=(rows, tuple(targets)), **extra)
            else:
                value = self._per_step()(*args, **extra)
        finally:
            self._criterion = None
        results = [call.results[offset] for offset in sorted(call.results)]
        self._finish_draws(key, call, state, results)
        replay(module, [(result.rows, result.logs) for result in results], self.root_device)
        if criterion is not None or returns == RETURNS_OUTPUT:
            return value
        outputs, counts = [result.output for result in results], [result.rows for result in results]
        if returns == RETURNS_NOTHING:
            return combine_outputs(outputs, counts, self.root_device)
        return training_output(method, value, outputs, counts, self.root_device)

    def _replica_loss(self, output: Any, target: tuple) -> torch.Tensor:
        """The loss a replica contributes: its step's loss, or the criterion on its output and its targets."""
        _, targets = target
        return output if self._criterion is None else self._criterion(output, *targets)

    def _run_here(self, method: str, args: tuple, kwargs: dict, criterion: Callable | None, targets: tuple) -> Any:
        if criterion is not None:
            return criterion(self.module(*args, **kwargs), *targets)
        return call_method(self.module, method, args, kwargs)

    def _prepare_replicas(self) -> None:
        """Replicas see the module as it is now: its training flags and, for persistent replicas, its plain
        attributes (the trainer, what hooks set between steps)."""
        module = self.module
        if self.persistent is None:
            # DataParallel copies every flag from the module; its own decides whether balance= measures
            self._per_step().training = self.step.training = module.training
            return
        # a tensor kept as a plain attribute is shared where the replicas share memory (virtual CPU devices)
        unshared = nn.Module if self.on_cpu else (torch.Tensor, nn.Module)
        attributes = {
            key: value
            for key, value in module.__dict__.items()
            if key not in _MODULE_KEYS and not isinstance(value, unshared)
        }
        for replica in self.persistent.replicas[1:]:
            replica.module.__dict__.update(attributes)
            for mine, theirs in zip(replica.modules(), self.step.modules()):
                mine.training = theirs.training

    def _per_step(self) -> DataParallel:
        """The per-step replicas' DataParallel (when the replicas do not persist)."""
        if self.data_parallel is None:
            raise RuntimeError(f"{type(self).__name__}: used after close(); wrap the module again")
        return self.data_parallel

    def _finish_draws(
        self, key: tuple[str, bool], call: StepCall, state: torch.Tensor | None, results: list[ReplicaResult]
    ) -> None:
        if state is None:
            return
        if call.state is not None:
            problems = finish_draws(state, [result.draws for result in results])
            drew = any(result.draws is not None and result.draws.drew for result in results)
            self._draws[key] = drew or bool(self._draws.get(key))
            for problem in problems:
                self._warn_once(
                    problem,
                    f"{call.method}: {problem} in dpkit's replicas: its random numbers are repeatable from the "
                    "seed but not those of one device, so results differ from a single-device run",
                )
        elif not torch.equal(state, torch.default_generator.get_state()):
            self._draws[key] = True  # it started drawing: from now on its replicas draw as one device
            self._warn_once(
                f"late:{call.method}",
                f"{call.method}: drew random numbers in a step after steps that drew none; that step's numbers "
                "were not those of one device (the following steps' are)",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    # --- backward and the optimizer step (persistent replicas) ----------------------------------------
    def before_backward(self) -> None:
        if self.persistent is not None and self.persistent.gradients is not None and self.sum_after_backward:
            self.persistent.gradients.release_copies()

    def after_backward(self) -> None:
        """A loss from gathered outputs (or an unreplicated step) reached the replicas' gradients on this
        thread, without the sum the replicas' combined loss runs: sum now (unless inside no_sum())."""
        if self.persistent is not None and self.sum_after_backward and self.summing:
            self.persistent.reduce_gradients()

    @contextlib.contextmanager
    def no_sum(self) -> Iterator[None]:
        """Backwards inside leave every persistent replica its own gradient; the first backward outside sums
        them all (gradient accumulation without the exchange on every micro-batch)."""
        if self.persistent is None:
            yield
            return
        previous, self.summing = self.summing, False
        try:
            with self.persistent.gradient_sync(False):
                yield
        finally:
            self.summing = previous

    def stepper(self, optimizer: torch.optim.Optimizer) -> PersistentOptimizer | None:
        """The persistent replicas' optimizer for the user's `optimizer` (made on first use); None when the
        replicas are per-step (the user's optimizer steps the module, which every replica copies)."""
        if self.persistent is None:
            return None
        stepper = self.steppers.get(id(optimizer))
        if stepper is None or stepper.user is not optimizer:
            stepper = self.steppers[id(optimizer)] = self.persistent.wrap_optimizer(optimizer)
        return stepper

    def before_step(self) -> None:
        """Replicas with a copy of the weights each step their own: they take the first replica's gradient,
        which Lightning may have clipped or a hook changed since the sum."""
        persistent = self.persistent
        if persistent is None or getattr(persistent, "shares_weights", False):
            return
        with torch.no_grad():
            for params in persistent.params[1:]:
                for mine, first in zip(params, persistent.params[0]):
                    mine.grad = None if first.grad is None else first.grad.to(mine.device, copy=True)

    def weights_loaded(self) -> None:
        if self.persistent is not None:
            self.persistent.weights_loaded()

    def optimizers_loaded(self) -> None:
        for stepper in self.steppers.values():
            stepper.load_state_dict(stepper.user.state_dict())

    def close(self) -> None:
        """Drop the replicas and the hooks their gradient sum put on the module's parameters."""
        if self.persistent is not None and self.persistent.gradients is not None:
            self.persistent.gradients.remove_hooks()
        object.__setattr__(self, "persistent", None)
        object.__setattr__(self, "data_parallel", None)
        self.steppers.clear()

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, devices=[{', '.join(str(d) for d in self.devices)}]"
