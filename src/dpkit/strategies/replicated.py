"""replicated: DDP's arithmetic in one process. One persistent replica per device, each with its own
optimizer; forward, loss and backward of a replica run in its device's worker thread, gradients are
summed among the replicas, and every replica steps itself.

Nothing is broadcast per step and no output is gathered on the first device: replicas start equal and
stay equal because they apply the same summed gradient with the same optimizer. Each replica's graph is
its own, so its backward runs in its thread, side by side with the others.

In the user's loop `model(x)` returns a DeferredOutput while training; the criterion from
`engine.setup_criterion(criterion)` runs every replica's forward and loss on its slice of the batch and
returns their sample-weighted mean, and `engine.backward(loss)` runs the backwards and the sum. Without
setup_criterion, `model(x)` gathers the outputs and the backward runs on the calling thread: correct,
but without the speed.
"""

from __future__ import annotations

import copy
import inspect
import threading
from typing import Any, Callable, Sequence

import torch
from torch import nn

from dpkit.devices import cpu_threads_per_device
from dpkit.parallel.apply import CallerContext, worker_for
from dpkit.parallel.gather import gather
from dpkit.parallel.scatter import batch_size_of, plan_split, scatter
from dpkit.parallel.streams import device_context
from dpkit.strategies.base import DeferredOutput, Strategy, defers


class ReplicatedModule(nn.Module):
    """The user's model (replica 0) as `module`; the other replicas are kept by the strategy, unregistered."""

    wraps_module = True  # dpkit.unwrap_model / save_model / load_model look inside

    def __init__(self, strategy: "Replicated", model: nn.Module):
        super().__init__()
        self.strategy = strategy
        self.module = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if defers(self.strategy, self):
            return DeferredOutput(self.strategy.name, args, kwargs)
        return self.strategy.forward(args, kwargs)

    def train(self, mode: bool = True) -> "ReplicatedModule":
        super().train(mode)
        for replica in self.strategy.replicas[1:]:
            replica.train(mode)
        return self


class ReplicaOptimizers:
    """The user's optimizer (replica 0's) and a copy per other replica; step() steps them all."""

    def __init__(self, strategy: "Replicated", optimizers: list[torch.optim.Optimizer]):
        self.strategy = strategy
        self.optimizers = optimizers

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
        self.strategy.step_replicas(self.optimizers)

    def state_dict(self) -> dict:
        return self.optimizers[0].state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        for optimizer in self.optimizers:
            optimizer.load_state_dict(copy.deepcopy(state_dict))


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's defaults its constructor accepts (some defaults are not constructor arguments,
    e.g. AdamW's decoupled_weight_decay); every param group carries its own values anyway."""
    parameters = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters}


def _rethrow(index: int, device: torch.device, error: BaseException) -> None:
    message = f"in replica {index} on device {device}: {type(error).__name__}: {error}"
    try:
        wrapped = type(error)(message)
    except Exception:
        wrapped = RuntimeError(message)
    raise wrapped from error


class Replicated(Strategy):
    name = "replicated"
    supports_grad_scaler = False  # one scaler over per-replica optimizers is not wired up yet

    def __init__(self, devices: Sequence[torch.device], *, threads_per_device: int | None = None):
        super().__init__(devices)
        self.on_cpu = all(device.type == "cpu" for device in self.devices)
        if threads_per_device is not None and (isinstance(threads_per_device, bool) or not isinstance(threads_per_device, int) or threads_per_device < 1):
            raise ValueError(f"threads_per_device: expected a positive int of intra-op threads per virtual CPU device, got {threads_per_device!r}")
        # intra-op threads per replica: a fair share of the cores unless given
        self.threads = (threads_per_device or cpu_threads_per_device(len(self.devices))) if self.on_cpu else None
        self.replicas: list[nn.Module] = []
        self.params: list[list[nn.Parameter]] = []
        self.buffers: list[list[torch.Tensor]] = []
        self._pending: tuple | None = None  # (returned loss, per-replica losses, weights, active replicas)

    # --- threads -----------------------------------------------------------------------------------
    def _run(self, indices: Sequence[int], job: Callable[[int], Any]) -> list[Any]:
        """job(i) for every replica index, each in its device's worker thread; errors name the replica."""

        def in_thread(i: int) -> Any:
            if self.threads is not None and torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
            with device_context(self.devices[i]):
                return job(i)

        futures = [(i, worker_for(self.devices[i]).submit(in_thread, i)) for i in indices]
        results, first_error = [], None
        for i, future in futures:  # wait for every replica, so none is left running
            try:
                results.append(future.result())
            except BaseException as error:  # noqa: BLE001 - re-raised below with the replica named
                results.append(None)
                if first_error is None or isinstance(first_error[1], threading.BrokenBarrierError):
                    first_error = (i, error)
        if first_error is not None:
            _rethrow(first_error[0], self.devices[first_error[0]], first_error[1])
        return results

    # --- setup -------------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.root_device)
        self.replicas = [model] + [copy.deepcopy(model).to(device) for device in self.devices[1:]]
        self.params = [list(replica.parameters()) for replica in self.replicas]
        self.buffers = [list(replica.buffers()) for replica in self.replicas]
        return ReplicatedModule(self, model)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> ReplicaOptimizers:
        position = {id(p): k for k, p in enumerate(self.params[0])}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in position:
                    raise ValueError(
                        f"optimizer: param_groups[{g}] holds a tensor that is not one of the model's parameters; "
                        "build the optimizer from model.parameters() and pass both to engine.setup(model, optimizer)"
                    )
        state = optimizer.state_dict()
        optimizers = [optimizer]
        for i in range(1, len(self.replicas)):
            groups = [
                {**{k: v for k, v in group.items() if k != "params"}, "params": [self.params[i][position[id(p)]] for p in group["params"]]}
                for group in optimizer.param_groups
            ]
            try:
                copy_i = type(optimizer)(groups, **_constructor_defaults(optimizer))
            except TypeError as error:
                raise TypeError(
                    f"optimizer: strategy 'replicated' builds one {type(optimizer).__name__} per replica as "
                    f"{type(optimizer).__name__}(param_groups, **defaults), which failed ({error}); use strategy='ddp' for this optimizer"
                ) from error
            copy_i.load_state_dict(copy.deepcopy(state))
            optimizers.append(copy_i)
        return ReplicaOptimizers(self, optimizers)

    def wrap_criterion(self, criterion: Callable) -> Callable:
        self.criterion = criterion

        def loss_in_replicas(output: DeferredOutput, *targets: Any, **criterion_kwargs: Any) -> torch.Tensor:
            return self.forward_loss(output, criterion, targets, criterion_kwargs)

        return loss_in_replicas

    # --- forward -----------------------------------------------------------------------------------
    def _sync_buffers(self) -> None:
        """Buffers (e.g. BatchNorm statistics) follow replica 0, as DDP broadcasts them from rank 0."""
        if self.buffers and self.buffers[0]:
            with torch.no_grad():
                for buffers in self.buffers[1:]:
                    for mine, first in zip(buffers, self.buffers[0]):
                        mine.copy_(first)

    def forward(self, args: tuple, kwargs: dict) -> Any:
        """Outputs gathered on the first device (eval, or training without setup_criterion)."""
        batch = batch_size_of(args, kwargs, 0)
        if batch is None:
            return self.replicas[0](*args, **kwargs)
        self._sync_buffers()
        plan = plan_split(batch, len(self.devices))
        chunks = scatter(args, kwargs, plan, self.devices, 0)
        active = [i for i, size in enumerate(plan.sizes) if size > 0]
        context = CallerContext.capture()

        def job(i: int) -> Any:
            _, args_i, kwargs_i = chunks[active.index(i)]
            with context.enter():
                return self.replicas[i](*args_i, **kwargs_i)

        return gather(self._run(active, job), self.root_device, 0)

    def forward_loss(self, output: DeferredOutput, criterion: Callable, targets: tuple, criterion_kwargs: dict) -> torch.Tensor:
        if not targets:
            raise TypeError("criterion: strategy 'replicated' expects criterion(model(x), target, ...) with at least one target")
        batch = batch_size_of((output.args, targets), output.kwargs, 0)
        if batch is None:
            raise ValueError("model inputs: strategy 'replicated' found no tensor to split along dim 0")
        self._sync_buffers()
        plan = plan_split(batch, len(self.devices))
        chunks = scatter((output.args, targets), output.kwargs, plan, self.devices, 0)
        active = [i for i, size in enumerate(plan.sizes) if size > 0]
        context = CallerContext.capture()

        def job(i: int) -> torch.Tensor:
            _, (args_i, targets_i), kwargs_i = chunks[active.index(i)]
            with context.enter():
                loss = criterion(self.replicas[i](*args_i, **kwargs_i), *targets_i, **criterion_kwargs)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(f"criterion: must return a scalar (0-dim) mean loss, got {type(loss).__name__} {getattr(loss, 'shape', '')}")
            return loss

        losses = self._run(active, job)
        weights = [plan.sizes[i] / batch for i in active]  # each replica's mean loss, weighted by its share
        value = sum(w * loss.detach().to(self.root_device) for w, loss in zip(weights, losses))
        self._pending = (value, losses, weights, active)
        return value

    # --- backward: per-replica backward in its thread, then the sum of gradients ---------------------
    def backward(self, loss: torch.Tensor, *, scale: float, sync: bool) -> None:
        pending, self._pending = self._pending, None
        if pending is None or loss is not pending[0]:
            if not loss.requires_grad:
                raise RuntimeError(
                    "loss: under strategy 'replicated' engine.backward(loss) takes the loss returned by the criterion "
                    "from engine.setup_criterion(criterion), unchanged; put extra loss terms inside that criterion"
                )
            (loss * scale if scale != 1.0 else loss).backward()  # through gathered outputs, on this thread
            if sync:
                self.reduce_gradients()
            return
        _, losses, weights, active = pending
        n = len(self.devices)
        if not (sync and self.on_cpu and n > 1):
            def backward_only(i: int) -> None:
                k = active.index(i)
                (losses[k] * (weights[k] * scale)).backward()
            self._run(active, backward_only)
            if sync:
                self.reduce_gradients()
            return
        barrier = threading.Barrier(n)

        def backward_then_sum(i: int) -> None:
            try:
                if i in active:
                    k = active.index(i)
                    (losses[k] * (weights[k] * scale)).backward()
                barrier.wait()
                if i == 0:
                    self._fill_missing_grads()
                barrier.wait()
                self._sum_chunk(i, n)
            except BaseException:
                barrier.abort()
                raise

        self._run(range(n), backward_then_sum)

    def _fill_missing_grads(self) -> None:
        """Zeros where one replica has no gradient for a parameter that another replica has one for."""
        for group in zip(*self.params):
            grads = [p.grad for p in group]
            present = next((g for g in grads if g is not None), None)
            if present is None:
                continue
            for p, g in zip(group, grads):
                if g is None:
                    p.grad = torch.zeros_like(p)

    def _sum_chunk(self, k: int, n: int) -> None:
        """Sum chunk k (of n) of every gradient over the replicas, and write it back to each."""
        with torch.no_grad():
            for group in zip(*self.params):
                grads = [p.grad for p in group]
                if grads[0] is None:
                    continue
                if not all(g.is_contiguous() for g in grads):
                    if k == 0:
                        total = torch.stack(grads).sum(0)
                        for g in grads:
                            g.copy_(total)
                    continue
                numel = grads[0].numel()
                lo, hi = numel * k // n, numel * (k + 1) // n
                if lo == hi:
                    continue
                parts = [g.view(-1)[lo:hi] for g in grads]
                total = parts[0]
                for part in parts[1:]:
                    total.add_(part)
                for part in parts[1:]:
                    part.copy_(total)

    def reduce_gradients(self) -> None:
        """Every replica's gradient becomes the sum over replicas."""
        n = len(self.devices)
        if n == 1:
            return
        self._fill_missing_grads()
        if self.on_cpu:
            self._run(range(n), lambda i: self._sum_chunk(i, n))
            return
        # GPUs: torch's CUDA collectives (NCCL where available) sum onto the first device and broadcast back
        from torch.cuda import comm

        with torch.no_grad():
            groups = [group for group in zip(*self.params) if group[0].grad is not None]
            if not groups:
                return
            per_device = [[p.grad for p in replica_params] for replica_params in zip(*groups)]
            summed = comm.reduce_add_coalesced(per_device, destination=self.root_device.index)
            copies = comm.broadcast_coalesced(summed, [d.index for d in self.devices])
            for grads, new in zip(per_device, copies):
                for g, value in zip(grads, new):
                    g.copy_(value)

    # --- step --------------------------------------------------------------------------------------
    def step_replicas(self, optimizers: list[torch.optim.Optimizer]) -> None:
        first = optimizers[0].param_groups
        for optimizer in optimizers[1:]:  # hyperparameters (e.g. a scheduler's lr) follow the user's optimizer
            for mine, theirs in zip(optimizer.param_groups, first):
                for key, value in theirs.items():
                    if key != "params":
                        mine[key] = value
        self._run(range(len(optimizers)), lambda i: optimizers[i].step())

    def weights_loaded(self) -> None:
        self.broadcast_from_first()

    def broadcast_from_first(self) -> None:
        """Copy replica 0's parameters and buffers to the others (after loading a checkpoint into it)."""
        with torch.no_grad():
            for i in range(1, len(self.replicas)):
                for mine, first in zip(self.params[i], self.params[0]):
                    mine.copy_(first)
        self._sync_buffers()
