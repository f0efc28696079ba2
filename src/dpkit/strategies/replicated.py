"""replicated: DDP's arithmetic in one process. One persistent replica per device, each with its own
optimizer; forward, loss and backward of a replica run in its device's worker thread, gradients are
summed among the replicas, and every replica steps itself.

Nothing is broadcast per step and no output is gathered on the first device: replicas start equal and
stay equal because they apply the same summed gradient with the same optimizer. Each replica's graph is
its own, so its backward runs in its thread, side by side with the others.

On virtual CPU devices, which share one memory, the replicas share more: every replica's parameters are
views of replica 0's storage (its own Parameter objects, so its own .grad), the gradient sum is a reduce
into replica 0, and the user's optimizer steps once, split in equal runs of elements among the replica threads
(replica_optimizers.SharedOptimizer). That is the same arithmetic with one copy of the weights and of the
optimizer state instead of one per device, and no step done twice. Buffers stay per replica.

In the user's loop `model(x)` returns a DeferredOutput while training; the criterion from
`engine.setup_criterion(criterion)` runs every replica's forward and loss on its slice of the batch and
returns their sample-weighted mean as one autograd node (strategies/combined_loss.py), so `loss.backward()`
or `engine.backward(loss)` runs the replicas' backwards and the gradient sum (parallel/reduce.py).
Without setup_criterion, `model(x)` gathers the outputs and the backward runs on the calling thread:
correct, but without the speed.

The parts: threads (parallel/apply.py's run_replicas), the sum (parallel/reduce.py), the optimizers
(replica_optimizers.py), the loss node (combined_loss.py); this module splits the batch and ties them.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dpkit.checks import check_int
from dpkit.devices import cpu_threads_per_device, keep_freed_host_memory
from dpkit.observe.collectives import RECORD
from dpkit.parallel import hooks, sync_batchnorm
from dpkit.parallel.apply import run_replicas
from dpkit.parallel.concurrency import THREADS, Concurrency, site_choices, site_policies
from dpkit.parallel.gather import ROW_MEAN, gather
from dpkit.parallel.reduce import GradientSum
from dpkit.parallel.replica_rng import TrainingModeWatches
from dpkit.parallel.replicate import check_replicable
from dpkit.parallel.scatter import batch_size_of, plan_split, scatter
from dpkit.strategies.base import (
    IN_REPLICAS,
    ONE_PROCESS,
    PERSISTENT,
    DeferredOutput,
    Strategy,
    Traits,
    criterion_sums,
    defers,
)
from dpkit.strategies.combined_loss import ReplicaStep, combined_loss
from dpkit.strategies.compressed_sum import CompressedSum, ReplicaPeers, load_saved_exchange, saved_exchange
from dpkit.strategies.compression import Compression, parse_compression
from dpkit.strategies.replica_optimizers import ReplicaOptimizers, SharedOptimizer, clone_optimizer


class ReplicatedModule(nn.Module):
    """The user's model (replica 0) as `module`; the other replicas are kept by the strategy, unregistered."""

    wraps_module = True  # dpkit.unwrap_model / save_model / load_model look inside

    def __init__(self, strategy: Replicated, model: nn.Module):
        super().__init__()
        self.strategy = strategy
        self.module = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if defers(self.strategy, self):
            return DeferredOutput(self.strategy.name, args, kwargs, run=lambda: self.strategy.forward(args, kwargs))
        return self.strategy.forward(args, kwargs)

    def train(self, mode: bool = True) -> ReplicatedModule:
        super().train(mode)
        for replica in self.strategy.replicas[1:]:
            replica.train(mode)
        return self


class Replicated(Strategy):
    name = "replicated"
    # one scaler over per-replica optimizers is not wired up yet: no '16-mixed'
    traits = Traits(
        processes=ONE_PROCESS, loss=IN_REPLICAS, replicas=PERSISTENT, shares_host_weights=True, grad_scaler=False
    )
    options = (
        "threads_per_device",
        "overlap_reduce",
        "share_weights",
        "coalesce_reduce",
        "concurrency",
        "compress",
        "compress_warmup_steps",
    )
    # the call sites whose replicas run side by side or serially (parallel/concurrency.py)
    concurrency_sites = ("forward", "forward_loss", "backward")

    def __init__(
        self,
        devices: Sequence[torch.device],
        *,
        threads_per_device: int | None = None,
        overlap_reduce: bool = True,
        share_weights: bool | None = None,
        coalesce_reduce: bool = True,
        concurrency: str | Mapping[str, str] = "auto",
        compress: str | Compression = "none",
        compress_warmup_steps: int | None = None,
        precision: str = "32",
    ):
        super().__init__(devices, precision=precision)
        # compress=: the replicas' gradients summed through the compressed exchange (compressed_sum.py), with the
        # arithmetic a 16-bit or low-rank exchange between devices gives
        compression = parse_compression(compress, compress_warmup_steps)
        self.exchange = CompressedSum(compression) if compression.compresses else None
        self.on_cpu = all(device.type == "cpu" for device in self.devices)
        if share_weights not in (None, True, False):
            raise TypeError(
                f"share_weights: expected True, False or None (virtual CPU devices share), got {share_weights!r}"
            )
        if share_weights and not self.on_cpu:
            raise ValueError(
                "share_weights: True needs virtual CPU devices ('cpu:0', 'cpu:1', …), which share one "
                f"memory; devices {[str(d) for d in self.devices]} each hold their own copy"
            )
        # virtual CPU devices share one memory, so by default their replicas share replica 0's weights;
        # False keeps a copy and an optimizer per device, as on GPUs (dpkit profile measures that layout)
        self.shares_weights = (self.on_cpu if share_weights is None else share_weights) and len(self.devices) > 1
        if threads_per_device is not None:
            check_int(threads_per_device, "threads_per_device", meaning="intra-op threads per virtual CPU device")
        # intra-op threads per replica: a fair share of the cores unless given
        self.threads = (threads_per_device or cpu_threads_per_device(len(self.devices))) if self.on_cpu else None
        self.overlap_reduce = bool(overlap_reduce)
        self.coalesce_reduce = bool(coalesce_reduce)  # False: the per-parameter sum of before (for measuring)
        self.replicas: list[nn.Module] = []
        self.params: list[list[nn.Parameter]] = []
        self.buffers: list[list[torch.Tensor]] = []
        self.gradients: GradientSum | None = None
        self._sync = True  # whether a backward ends with the gradient sum; see gradient_sync()
        self._replica_backwards = 0  # backwards that went through the replicas' loss node
        self._last_step: ReplicaStep | None = None  # the latest combined loss's, until a backward uses it
        self.has_sync_batchnorm = False  # set with the replicas
        self.randomness = TrainingModeWatches("replicated's replicas")  # per-replica generators while they draw
        # how each call site runs its replicas: declared, or auto (measured once, then frozen)
        self.concurrency: dict[str, Concurrency] = site_policies(concurrency, self.concurrency_sites)

    @classmethod
    def profile_options(cls) -> dict[str, Any]:
        return {"share_weights": False}  # a copy of the weights and an optimizer state per device, as on GPUs

    # --- setup -------------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        check_replicable(model)  # a compiled, scripted or lazy module cannot be copied per device
        model = model.to(self.root_device)
        if self.shares_weights:
            keep_freed_host_memory()  # each replica thread would otherwise page-fault its activations every step
        self.replicas = [model] + [self._replica(model, device) for device in self.devices[1:]]
        self.params = [list(replica.parameters()) for replica in self.replicas]
        self.buffers = [list(replica.buffers()) for replica in self.replicas]
        sync_batchnorm.link_replicas(
            self.replicas
        )  # SyncBatchNorm: whole-batch statistics, running stats on the user's
        # the replicas are built once, so whether they hold SyncBatchNorm layers is known from here on
        self.has_sync_batchnorm = sync_batchnorm.has_sync_batchnorm(model)
        if self.gradients is not None:
            self.gradients.remove_hooks()
        self.gradients = GradientSum(
            self.params,
            self.devices,
            overlap=self.overlap_reduce,
            threads=self.threads,
            everywhere=not self.shares_weights,
            coalesce=self.coalesce_reduce,
            concurrency=self.concurrency["backward"],
            exchange=self._compressed_sum if self.exchange is not None else None,
        )
        self.names = [name for name, _ in model.named_parameters()]
        self._exchanged_bytes = 0
        return ReplicatedModule(self, model)

    def _compressed_sum(self, positions: list[int], grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """The replicas' gradients of the parameters at `positions`, summed through the compressed exchange."""
        assert self.exchange is not None  # (GradientSum is given this only with an exchange)
        peers = ReplicaPeers(len(self.replicas), self.root_device)
        means = self.exchange([self.names[p] for p in positions], grads, peers)
        self._exchanged_bytes = peers.sent_bytes
        return [mean * peers.count for mean in means]  # GradientSum sums; the loss weights made the sum the mean

    def process_state(self) -> dict[str, Any] | None:
        return saved_exchange(self.exchange)

    def load_process_state(self, state: dict[str, Any]) -> str | None:
        return load_saved_exchange(self.exchange, state, self.root_device)

    def _replica(self, model: nn.Module, device: torch.device) -> nn.Module:
        replica = copy.deepcopy(model).to(device)
        if self.shares_weights:
            for mine, first in zip(replica.parameters(), model.parameters()):
                mine.data = first.data  # its own leaf (own .grad, own hooks) over replica 0's storage
        return replica

    def model_copies(self, model: nn.Module) -> list[tuple[nn.Module, torch.device]]:
        return list(zip(self.replicas, self.devices))

    def gradient_holders(self, model: nn.Module) -> list[list[torch.Tensor]]:
        # on GPUs every replica holds the summed gradient and steps itself; on virtual CPU devices replica 0 does
        return [list(params) for params in self.params] if not self.shares_weights else [list(self.params[0])]

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> ReplicaOptimizers | SharedOptimizer:
        if self.shares_weights:
            return SharedOptimizer(optimizer, self.params, self.devices, self.threads)
        clones = [clone_optimizer(optimizer, self.params[0], self.params[i]) for i in range(1, len(self.replicas))]
        return ReplicaOptimizers([optimizer, *clones], self.devices, self.threads)

    def wrap_criterion(self, criterion: Callable) -> Callable:
        self.criterion = criterion

        def loss_in_replicas(output: DeferredOutput, *targets: Any, **criterion_kwargs: Any) -> torch.Tensor:
            return self.forward_loss(output, criterion, targets, criterion_kwargs)

        return loss_in_replicas

    # --- the batch ----------------------------------------------------------------------------------
    def _sync_buffers(self) -> None:
        """Buffers (e.g. BatchNorm statistics) follow replica 0, as DDP broadcasts them from rank 0."""
        if self.buffers and self.buffers[0]:
            with torch.no_grad():
                for buffers in self.buffers[1:]:
                    for mine, first in zip(buffers, self.buffers[0]):
                        mine.copy_(first)

    def split(self, args: tuple, kwargs: dict, batch: int) -> tuple[list[int], list[float], list[tuple[tuple, dict]]]:
        """(replicas that get rows, their share of the batch, their (args, kwargs)) for one batch."""
        self._sync_buffers()
        plan = plan_split(batch, len(self.devices))
        hooks.split(self.replicas[0], self.devices, self.root_device, plan.sizes)
        with hooks.phase("scatter", self.root_device):
            chunks = scatter(args, kwargs, plan, self.devices, 0)
        active = [i for i, size in enumerate(plan.sizes) if size > 0]
        return active, [plan.sizes[i] / batch for i in active], [(a, k) for _, a, k in chunks]

    # --- forward -----------------------------------------------------------------------------------
    def forward(self, args: tuple, kwargs: dict) -> Any:
        """Outputs gathered on the first device (eval, or training without setup_criterion)."""
        batch = batch_size_of(args, kwargs, 0)
        if batch is None:
            return self.replicas[0](*args, **kwargs)
        active, weights, chunks = self.split(args, kwargs, batch)

        def forward_one(k: int) -> Any:
            args_k, kwargs_k = chunks[k]
            return self.replicas[active[k]](*args_k, **kwargs_k)

        forward_one, group = sync_batchnorm.synced_job(
            self.replicas[0], forward_one, len(active), has_sync=self.has_sync_batchnorm
        )
        outputs = run_replicas(
            [self.devices[i] for i in active],
            forward_one,
            threads=self.threads,
            generators=self.randomness(self.replicas[0]),
            # SyncBatchNorm's replicas wait for each other: side by side
            concurrency=self.concurrency["forward"] if group is None else THREADS,
        )
        with hooks.phase("gather", self.root_device):
            # a loss the model computes (0-dim per replica): the row-weighted mean, as a criterion's would be
            rows = [round(w * batch) for w in weights]
            return gather(outputs, self.root_device, 0, rows=rows, scalars=ROW_MEAN)

    def forward_loss(
        self, output: DeferredOutput, criterion: Callable, targets: tuple, criterion_kwargs: dict
    ) -> torch.Tensor:
        if not targets:
            raise TypeError(
                "criterion: strategy 'replicated' expects criterion(model(x), target, ...) with at least one target"
            )
        batch = batch_size_of((output.args, targets), output.kwargs, 0)
        if batch is None:
            raise ValueError("model inputs: strategy 'replicated' found no tensor to split along dim 0")
        active, weights, chunks = self.split((output.args, targets), output.kwargs, batch)
        if criterion_sums(criterion):  # each replica's loss is a sum over its items: the batch's is their sum
            weights = [1.0] * len(weights)

        def forward_and_loss(k: int) -> torch.Tensor:
            (args_k, targets_k), kwargs_k = chunks[k]
            out = self.replicas[active[k]](*args_k, **kwargs_k)
            with hooks.replica_phase("loss"):
                loss = criterion(out, *targets_k, **criterion_kwargs)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(
                    "criterion: must return a scalar (0-dim) loss, a mean or a sum over its rows, "
                    f"got {type(loss).__name__} {getattr(loss, 'shape', '')}"
                )
            return loss

        forward_and_loss, group = sync_batchnorm.synced_job(
            self.replicas[0], forward_and_loss, len(active), has_sync=self.has_sync_batchnorm
        )
        losses = run_replicas(
            [self.devices[i] for i in active],
            forward_and_loss,
            threads=self.threads,
            generators=self.randomness(self.replicas[0]),
            concurrency=self.concurrency["forward_loss"] if group is None else THREADS,
        )
        step = ReplicaStep(
            active, losses, weights, self._gradient_sum(), sync=lambda: self._sync, ran=self._count_backward
        )
        step.joined = group is not None and group.joined  # SyncBatchNorm joined the replicas' graphs
        self._last_step = step
        with hooks.phase("loss", self.root_device):
            return combined_loss(step, self.root_device)

    def loss_is_sum(self) -> None:
        # the replicas' losses are sums over their items: added, not weighted by rows
        step, self._last_step = self._last_step, None
        if step is not None:
            step.weights = [1.0] * len(step.weights)

    def concurrency_choice(self) -> dict[str, str]:
        return site_choices(self.concurrency)

    def set_concurrency(self, concurrency: str | Mapping[str, str]) -> None:
        self.concurrency = site_policies(concurrency, self.concurrency_sites)
        if self.gradients is not None:
            self.gradients.concurrency = self.concurrency["backward"]

    def _count_backward(self) -> None:
        self._replica_backwards += 1

    # --- backward ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def gradient_sync(self, sync: bool) -> Iterator[None]:
        """Backwards inside end with (sync=True) or without (False, accumulating) the gradient sum.
        Outside any such block, a plain loss.backward() sums."""
        previous, self._sync = self._sync, sync
        try:
            yield
        finally:
            self._sync = previous

    def backward(self, loss: torch.Tensor, *, scale: float, sync: bool) -> None:
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise RuntimeError(
                "loss: under strategy 'replicated' engine.backward(loss) takes a loss computed from the model's output "
                "(the criterion from engine.setup_criterion(criterion)), and this one does not require grad"
            )
        before = self._replica_backwards
        gradients = self._gradient_sum()
        gradients.release_copies()  # the gathered-outputs path below adds into the replicas' gradients directly
        with self.gradient_sync(sync):
            (loss * scale if scale != 1.0 else loss).backward()
        if sync and self._replica_backwards == before:
            # the loss came from gathered outputs: the backward ran on this thread; sum now
            gradients.sum_now()
        if sync and self.exchange is not None:
            self.exchange.step_done()
        if sync and len(self.replicas) > 1:
            RECORD.count_bytes(self._sent_bytes(), gradients=True)

    def _sent_bytes(self) -> int:
        """What one replica would send into the gradients' exchange this step, were its devices linked by a
        collective (what `communication_bytes` and `gradient_bytes_per_step` count for replicated)."""
        if self.exchange is not None:
            sent, self._exchanged_bytes = self._exchanged_bytes, 0
            return sent
        return sum(p.grad.numel() * p.grad.element_size() for p in self.params[0] if p.grad is not None)

    def reduce_gradients(self) -> None:
        """Every replica's gradient becomes the sum over replicas."""
        self._gradient_sum().sum_now()

    def _gradient_sum(self) -> GradientSum:
        if self.gradients is None:
            raise RuntimeError("replicated: the replicas are made by engine.setup(model, optimizer); call it first")
        return self.gradients

    # --- checkpoints -------------------------------------------------------------------------------
    def weights_loaded(self) -> None:
        self.broadcast_from_first()

    def broadcast_from_first(self) -> None:
        """Copy replica 0's parameters and buffers to the others (after loading a checkpoint into it)."""
        with torch.no_grad():
            for i in range(1, len(self.replicas)):
                for mine, first in zip(self.params[i], self.params[0]):
                    if mine.data_ptr() != first.data_ptr():  # shared storage is already equal
                        mine.copy_(first)
        self._sync_buffers()
