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
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, NoReturn, Protocol, runtime_checkable

import torch
from torch import nn

from dpkit.devices import DeviceLike, cpu_devices, parse_device_list
from dpkit.integrations.lightning.logs import logs_values, recorded_logs, replay
from dpkit.parallel import DataParallel
from dpkit.parallel.nested import is_namedtuple
from dpkit.parallel.reduce import GradientSum
from dpkit.parallel.scatter import batch_size_of
from dpkit.parallel.whole_batch_rng import WholeBatchDraws, finish_draws
from dpkit.strategies import PERSISTENT, DeferredOutput, create_strategy, matching, strategy_class

log = logging.getLogger("dpkit")

TRAINING_STEP = "training_step"
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
_CALL = "dpkit_call"  # keyword arguments that travel with the batch to every replica, never to the module
_ROWS = "dpkit_rows"
# what a replica hands back: its loss (the loss path), its output (forward: gathered by dpkit), or nothing
# (the other steps: their outputs are combined from the call's results)
RETURNS_LOSS, RETURNS_OUTPUT, RETURNS_NOTHING = "loss", "output", "nothing"
_ONLY_LOSS = object()  # what a training_step that returned a bare loss tensor leaves besides its loss
_MODULE_KEYS = frozenset(nn.Module().__dict__) | {"_device", "_dtype", "log", "log_dict"}


def modes() -> list[str]:
    """dpkit's strategies with one process and a thread per device: the modes these strategies offer."""
    return matching(lambda traits: traits.threads_per_step)


def check_mode(mode: object) -> str:
    accepted = modes()
    if not isinstance(mode, str) or mode not in accepted:
        listed = ", ".join(repr(m) for m in accepted)
        raise ValueError(
            f"mode: expected one of {listed} (one process, a replica per device), got {mode!r}; "
            "for one process per device use Lightning's own strategy='ddp'"
        )
    return mode


def check_options(mode: str, options: Mapping[str, Any]) -> dict[str, Any]:
    known = strategy_class(mode).options
    for name in options:
        if name not in known:
            raise TypeError(f"{name}: not an option of mode {mode!r} (its options: {', '.join(known) or 'none'})")
    return dict(options)


def check_devices(devices: object) -> list[torch.device] | int | None:
    """devices as given to a strategy: a list of device specs, a count (devices of the accelerator Lightning
    chose), or None (Lightning's own devices= decides)."""
    if devices is None:
        return None
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(
                f"devices: expected a positive count, a list such as ['cpu:0', 'cpu:1'] or [0, 1], got {devices}"
            )
        return devices
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise TypeError(
            f"devices: expected a list such as ['cpu:0', 'cpu:1'] (virtual CPU devices) or [0, 1] (GPUs), a count, "
            f"or None, got {devices!r}"
        )
    return parse_device_list(devices, argument="devices")


def resolve_devices(
    asked: list[torch.device] | int | None, offered: Sequence[torch.device | str | int] | None
) -> list[torch.device]:
    """The devices to run on: `asked` (check_devices) completed with what Lightning's connector `offered` (its
    accelerator's devices for Trainer(devices=...)): a count takes the offered kind, None the offered count.
    Several CPU devices offered are virtual CPU devices cpu:0, cpu:1, ... Empty while nothing is known."""
    if isinstance(asked, list):
        return asked
    given = [torch.device(d) if not isinstance(d, torch.device) else d for d in (offered or [])]
    if not given:
        return []
    kind = given[0].type
    count = len(given) if asked is None else asked
    if asked is not None and len(given) > 1 and len(given) != asked:
        raise ValueError(
            f"devices: the strategy was given devices={asked} but Lightning's devices= gives {len(given)}; "
            "give the devices in one place"
        )
    if kind == "cpu":
        return cpu_devices(count)
    if asked is None:
        return parse_device_list(given, argument="devices")
    return parse_device_list([torch.device(kind, i) for i in range(count)], argument="devices")


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


def _loss_of(method: str, output: object, device: torch.device) -> tuple[torch.Tensor, object]:
    """(the loss a replica hands back, what it leaves besides) for training_step's output."""
    if output is None:  # the step skips this batch: a stand-in loss, never backpropagated
        return torch.zeros((), device=device), None
    if isinstance(output, torch.Tensor):
        loss, rest = output, _ONLY_LOSS
    elif isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        loss, rest = output["loss"], {key: value for key, value in output.items() if key != "loss"}
    else:
        raise TypeError(
            f"{method}: must return a loss tensor, a dict with a 'loss' tensor, or None; got {type(output).__name__}"
        )
    if loss.dim() != 0:
        raise ValueError(
            f"{method}: must return a 0-dim loss (a mean over the rows it was given), got shape {tuple(loss.shape)}"
        )
    return loss, rest


class _Step(nn.Module):
    """What each replica runs: one method of its copy of the module, its log calls recorded, its random
    numbers drawn as one device would (virtual CPU devices)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        call: StepCall = kwargs.pop(_CALL)
        rows = kwargs.pop(_ROWS)
        offset, count = int(rows[0]), rows.numel()
        module = self.module
        if rows.device.type != "cpu" and module.__dict__.get("_device", rows.device) != rows.device:
            module.__dict__["_device"] = rows.device  # a LightningModule's self.device, in this replica
        draws = WholeBatchDraws(call.state, offset, count, call.total) if call.state is not None else None
        with recorded_logs(module, logs_values(module)) as logs:
            if draws is not None:
                with draws:
                    output = self._call(module, call.method, args, kwargs)
            else:
                output = self._call(module, call.method, args, kwargs)
        if call.returns == RETURNS_LOSS:
            loss, rest = _loss_of(call.method, output, rows.device)
            call.results[offset] = ReplicaResult(count, rest, logs, draws)
            return loss
        if call.returns == RETURNS_OUTPUT:
            call.results[offset] = ReplicaResult(count, None, logs, draws)
            return output
        call.results[offset] = ReplicaResult(count, output, logs, draws)
        return None

    @staticmethod
    def _call(module: nn.Module, method: str, args: tuple, kwargs: dict) -> Any:
        return module(*args, **kwargs) if method == "forward" else getattr(module, method)(*args, **kwargs)


def combine_outputs(values: Sequence[Any], rows: Sequence[int], device: torch.device) -> Any:
    """One output from the replicas' outputs of a step, as one device's output for the whole batch:
    tensors with the replicas' rows along dim 0 are concatenated in row order; a floating 0-dim tensor (a
    mean, such as a loss) is the replicas' values weighted by their rows; an integer 0-dim tensor (a count)
    is their sum; dicts, lists and tuples are combined item by item; None stays None; other values equal in
    every replica are that value, else the list of the replicas' values (as is any other tensor)."""
    first = values[0]
    if all(value is None for value in values):
        return None
    if all(isinstance(value, torch.Tensor) for value in values):
        moved = [value if device.type == "cpu" else value.to(device) for value in values]
        if first.dim() == 0 and all(value.dim() == 0 for value in values):
            if first.is_floating_point():
                total = sum(rows)
                return sum(value * (n / total) for value, n in zip(moved, rows))
            return sum(moved[1:], moved[0])
        if all(value.dim() > 0 and value.shape[0] == n for value, n in zip(values, rows)):
            return torch.cat(moved)
        return list(values)
    if isinstance(first, Mapping) and all(isinstance(v, Mapping) and v.keys() == first.keys() for v in values):
        mapping_class: Any = type(first)  # the user's Mapping class, built from a dict
        return mapping_class({key: combine_outputs([v[key] for v in values], rows, device) for key in first})
    if isinstance(first, (list, tuple)) and all(type(v) is type(first) and len(v) == len(first) for v in values):
        parts = [combine_outputs([v[k] for v in values], rows, device) for k in range(len(first))]
        return type(first)(*parts) if is_namedtuple(first) else type(first)(parts)
    if all(_same(value, first) for value in values[1:]):
        return first
    return list(values)


def _same(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def redirected_method(module: nn.Module) -> str | None:
    """The LightningModule method Fabric routes through `forward` (fabric_model.training_step(...)), or None.

    Fabric patches the module's forward with a closure that calls `module.<method_name>`: run in replicas,
    it would run the original module's method in every replica. The patch is undone here and the method's
    name returned, so the replicas run their own."""
    patched = module.__dict__.get("forward")
    if patched is None:
        return None
    if getattr(patched, "__self__", None) is module:
        if getattr(patched, "__func__", None) is type(module).forward:
            # what an earlier redirect leaves behind: per-step replicas would copy it and run the original
            del module.__dict__["forward"]
        return None
    code, cells = getattr(patched, "__code__", None), getattr(patched, "__closure__", None)
    if code is None or not cells:
        return None
    found = {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    method, original = found.get("method_name"), found.get("original_forward")
    if not isinstance(method, str) or original is None:
        return None
    if getattr(original, "__self__", None) is module and getattr(original, "__func__", None) is type(module).forward:
        del module.__dict__["forward"]  # the class's forward again, with nothing left in the instance
    else:
        module.forward = original
    return method


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
    step: _Step
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
        step = _Step(module)
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
        extra = {**kwargs, _CALL: call, _ROWS: rows}
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
        return self._training_output(method, value, outputs, counts)

    def _training_output(self, method: str, loss: torch.Tensor, outputs: list, counts: list[int]) -> Any:
        skipped = [output is None for output in outputs]
        if all(skipped):
            return None
        if any(skipped):
            raise RuntimeError(
                f"{method}: returned None (skip the batch) in some replicas and a loss in others; a step that "
                "skips must skip for the whole batch (decide from something every replica sees, not from its rows)"
            )
        if outputs[0] is _ONLY_LOSS:
            return loss
        return {"loss": loss, **combine_outputs(outputs, counts, self.root_device)}

    def _replica_loss(self, output: Any, target: tuple) -> torch.Tensor:
        """The loss a replica contributes: its step's loss, or the criterion on its output and its targets."""
        _, targets = target
        return output if self._criterion is None else self._criterion(output, *targets)

    def _run_here(self, method: str, args: tuple, kwargs: dict, criterion: Callable | None, targets: tuple) -> Any:
        if criterion is not None:
            return criterion(self.module(*args, **kwargs), *targets)
        return _Step._call(self.module, method, args, kwargs)

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


class DeferredForward:
    """What a Fabric model returns in training under a strategy's criterion (setup_criterion): nothing has
    run yet; the criterion runs the forward and the loss in each replica."""

    def __init__(self, replicas: StepReplicas, args: tuple, kwargs: dict):
        self.replicas, self.args, self.kwargs = replicas, args, kwargs

    def __getattr__(self, name: str) -> NoReturn:
        raise AttributeError(
            f"model(x) returns a deferred output (no .{name}) while training with a criterion from "
            "strategy.setup_criterion(criterion): the forward runs inside the replicas together with the loss. "
            "Pass it to that criterion; for plain outputs call model.eval() or use torch.no_grad()"
        )
