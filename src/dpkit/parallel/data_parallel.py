"""dpkit.DataParallel: scatter -> replicate -> parallel apply -> gather, on GPUs or virtual CPU devices."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from dpkit.checks import check_dim
from dpkit.devices import DeviceLike, parse_device, parse_device_list, tensor_on
from dpkit.parallel import hooks, sync_batchnorm
from dpkit.parallel.apply import parallel_apply
from dpkit.parallel.balance import BALANCE_MODES
from dpkit.parallel.concurrency import THREADS, Concurrency, site_choices, site_policies
from dpkit.parallel.gather import gather
from dpkit.parallel.nested import leaves
from dpkit.parallel.replica_cache import ReplicaCache
from dpkit.parallel.replica_rng import TrainingModeWatches
from dpkit.parallel.replicate import check_replicable, replicate
from dpkit.parallel.scatter import batch_size_of, check_chunk_sizes, other_sizes, plan_split, scatter, unwrap_broadcasts

LOSS_REDUCTIONS = ("mean", "sum")
CONCURRENCY_SITES = ("train", "eval")  # DataParallel's call sites: its forward in each training mode
SITE = {True: "train", False: "eval"}


class ChunkPlanner(Protocol):
    """Chooses rows per device for each call (balance=): DataParallel asks at the start of every call.

    A planner that measures steps (dpkit.observe's, plugged in through hooks.set_balance_planner) measures
    from one call to the next and closes its measurement in finish(), which DataParallel calls at the start
    of the next call. Its state_dict() holds what it learned, so a resumed run splits as the saved one did
    (StatefulChunkPlanner)."""

    def chunk_sizes(self, batch_size: int, can_measure: bool) -> list[int] | None: ...
    def finish(self) -> None: ...


@runtime_checkable
class StatefulChunkPlanner(ChunkPlanner, Protocol):
    """A ChunkPlanner that keeps what it learned in its state_dict() (dpkit.observe's measured balance)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ReplicaWithLoss:
    """What a replica runs when DataParallel has a loss_fn: its forward, then the loss on its slice of
    the target, so only a scalar per replica crosses to the output device."""

    def __init__(self, replica: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]):
        self.replica = replica
        self.loss_fn = loss_fn

    def __call__(self, *args: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        output = self.replica(*args, **kwargs)
        with hooks.replica_phase("loss"):
            loss = self.loss_fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn: must return a 0-dim tensor (reduce the replica's rows with 'mean' or 'sum'), got {shape}"
            )
        return loss


def combine_losses(
    losses: Sequence[torch.Tensor], rows: Sequence[int], reduction: str, device: torch.device
) -> torch.Tensor:
    """The whole batch's loss from per-replica losses: 'mean' weights each by its share of the rows
    (an unweighted mean of means is wrong for uneven splits), 'sum' adds them."""
    batch_size = sum(rows)
    moved = [loss if device.type == "cpu" else loss.to(device) for loss in losses]
    if reduction == "sum":
        return torch.stack(moved).sum()
    # typeshed's sum() is int | Tensor (its start, 0, when empty); there is a loss per replica with rows
    return sum(loss * (n / batch_size) for loss, n in zip(moved, rows))  # type: ignore[return-value]


def check_max_bytes(max_bytes_per_device: object, devices: Sequence[torch.device]) -> list[float | None]:
    """One limit per device: given (an int for all, or a list), else 90% of a CUDA device's memory
    (headroom for the CUDA context and allocator fragmentation); no limit on CPU."""
    if max_bytes_per_device is None:
        return [
            int(0.9 * torch.cuda.get_device_properties(d).total_memory) if d.type == "cuda" else None for d in devices
        ]
    values = (
        list(max_bytes_per_device)
        if isinstance(max_bytes_per_device, (list, tuple))
        else [max_bytes_per_device] * len(devices)
    )
    if len(values) != len(devices):
        raise ValueError(
            f"max_bytes_per_device: has {len(values)} entries for {len(devices)} devices; "
            "give one limit per device or a single int"
        )
    limits: list[float | None] = []
    for i, value in enumerate(values):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"max_bytes_per_device[{i}]: expected a positive number of bytes or None, got {value!r}")
        limits.append(value)
    return limits


class DataParallel(nn.Module):
    """Split each call's batch across devices, run one replica per device, gather the outputs.

    Args:
        module: the model; its parameters and buffers must live on the first device.
        device_ids: ints (CUDA indices), strings ("cuda:1", "cpu:3") or torch.device; None means every
            visible GPU. Virtual CPU devices come from `dpkit.cpu_devices(n)`.
        output_device: where outputs are gathered (default: the first device).
        dim: the batch dimension to split along.
        chunk_sizes: rows per device (must add up to the batch); 0 leaves a device out entirely.
        loss_fn: `loss_fn(output, target) -> 0-dim tensor`, computed inside each replica on its slice.
            Then `dp(x, target=y)` returns the batch's loss instead of the outputs (`target` is split
            like the inputs); without `target=` the call returns outputs as usual.
        loss_reduction: how loss_fn reduces its rows, "mean" (default) or "sum"; replica losses are
            combined so the loss and every gradient equal a single-device run's. A mean over anything
            other than rows (class weights, ignore_index) must use reduction="sum" and divide outside.
        balance: "memory" measures two training steps after a warm-up step, then picks chunk sizes
            that equalise predicted peak memory (device 0 gets fewer rows); "speed" gives rows in
            proportion to measured throughput (one measured step). Re-solved whenever the batch size changes.
            Exclusive with chunk_sizes.
            The steps are measured by dpkit.observe (plugged in through dpkit.parallel.hooks).
        max_bytes_per_device: per-device memory limit for balance="memory" (an int for all or a list);
            default: 90% of a CUDA device's memory, no limit on CPU. No device is given rows past it.
        planner: the ChunkPlanner that chooses rows per call for `balance` (default: balance_planner()).
        cache_replicas: keep the replicas' module objects between calls and make only their tensors anew
            (parallel/replica_cache.py: rebuilt whenever the module changed, so never stale); False builds
            every replica from scratch at every call, as torch does.
        concurrency: how the replicas' forwards run: "threads" (side by side in the device threads, as torch),
            "serial" (one after the other on the calling thread: faster for models of many small layers on
            virtual CPU devices), "auto" (the default: measured on the first calls, then frozen; one choice for
            training mode and one for eval mode), or what `concurrency_choice()` returned, to run as a saved run
            decided. Results are the same either way. Replicas with SyncBatchNorm always run threads.

    The wrapper's parameters are the module's own parameter objects and `state_dict()` keys carry a
    `module.` prefix as in torch; `dpkit.save_model` writes them without it.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        *,
        chunk_sizes: Sequence[int] | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        loss_reduction: str = "mean",
        balance: str | None = None,
        max_bytes_per_device: int | Sequence[int | None] | None = None,
        planner: ChunkPlanner | None = None,
        cache_replicas: bool = True,
        concurrency: str | Mapping[str, str] = "auto",
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
        check_dim(dim)  # negative dims count from the end of each input, as in torch
        check_replicable(module)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                f"loss_fn: expected a callable loss_fn(output, target) -> 0-dim tensor, got {type(loss_fn).__name__}"
            )
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                "loss_reduction: expected 'mean' or 'sum' (how loss_fn reduces a replica's rows), "
                f"got {loss_reduction!r}"
            )
        if balance is not None and balance not in BALANCE_MODES:
            raise ValueError(f"balance: expected 'memory', 'speed' or None, got {balance!r}")
        if balance is not None and chunk_sizes is not None:
            raise ValueError("balance and chunk_sizes: give one; balance chooses the chunk sizes itself")
        self.module = module
        self.device_ids: list[torch.device] = parse_device_list(device_ids)
        self.output_device: torch.device = (
            self.device_ids[0] if output_device is None else parse_device(output_device, argument="output_device")
        )
        self.dim = dim
        self.chunk_sizes = check_chunk_sizes(chunk_sizes, len(self.device_ids))
        self.loss_fn = loss_fn
        self.loss_reduction = loss_reduction
        self.balance = balance
        if planner is not None and balance is None:
            raise ValueError("planner: chooses the rows for balance=; give balance='memory' or 'speed' too")
        self.balancer: ChunkPlanner | None = None
        if balance is not None:
            limits = check_max_bytes(max_bytes_per_device, self.device_ids)
            self.balancer = planner if planner is not None else self.balance_planner(balance, limits)
        self.last_split_sizes: list[int] | None = None
        self.last_devices: list[torch.device] | None = None  # the devices that got rows (and a replica)
        self.randomness = TrainingModeWatches("DataParallel's replicas")  # per-replica generators while they draw
        self.concurrency: dict[str, Concurrency] = {}
        self.set_concurrency(concurrency)
        if cache_replicas not in (True, False):
            raise TypeError(f"cache_replicas: expected True or False, got {cache_replicas!r}")
        self.replica_cache: ReplicaCache | None = ReplicaCache(module) if cache_replicas else None

    def balance_planner(self, mode: str, max_bytes_per_device: list[float | None]) -> ChunkPlanner:
        """The planner for balance=mode: the one plugged into the observation seam (dpkit.observe's)."""
        planner = hooks.balance_planner(mode, self.device_ids, max_bytes_per_device)
        if planner is None:
            raise ValueError(
                f"balance: {mode!r} needs a planner that measures steps and none is plugged in "
                "(importing dpkit.observe plugs one in, as dpkit.DataParallel and strategy 'dp-balanced' do); "
                "or pass planner="
            )
        return planner

    def set_concurrency(self, concurrency: str | Mapping[str, str]) -> None:
        """How the forwards run from the next call: what the constructor's `concurrency` takes (a run that
        resumes gives back the saved `concurrency_choice()` here, after the wrapper was made)."""
        # a call site per training mode: a training-mode forward and an eval-mode one cost differently
        self.concurrency = site_policies(concurrency, CONCURRENCY_SITES)

    def concurrency_choice(self) -> dict[str, str]:
        """The forwards' frozen ways ({"train": "serial", ...}), a plain value to record and give back as
        `concurrency=` (a site still measuring is left out, and measures again)."""
        return site_choices(self.concurrency)

    @property
    def primary_device(self) -> torch.device:
        return self.device_ids[0]

    def check_placement(self, cache: ReplicaCache | None = None) -> None:
        """Every parameter and buffer must be on the primary device before any replica runs."""
        primary = self.primary_device
        if cache is not None and cache.all_on(primary):
            return  # every forward: the cache's list of the module's tensors
        if all(tensor_on(t, primary) for t in itertools.chain(self.module.parameters(), self.module.buffers())):
            return  # without building the names
        for kind, named in (("parameter", self.module.named_parameters()), ("buffer", self.module.named_buffers())):
            for name, tensor in named:
                if not tensor_on(tensor, primary):
                    raise RuntimeError(
                        f"{kind} '{name}' is on {tensor.device} but DataParallel's primary device is {primary}; "
                        f"move the module there first (module.to('{primary}'))"
                    )

    def forward(self, *inputs: Any, target: Any = None, **kwargs: Any) -> Any:
        cache = self.take_cache()
        try:
            return self.split_run_combine(cache, inputs, target, kwargs)
        finally:
            if cache is not None:
                cache.release()

    def take_cache(self) -> ReplicaCache | None:
        """The replica cache for this call (its module checked), or None: not caching, or another call has it."""
        cache = self.replica_cache
        if cache is None:
            return None
        if cache.module is not self.module:  # the wrapped module was replaced
            cache = self.replica_cache = ReplicaCache(self.module)
        return cache if cache.acquire() else None

    def split_run_combine(self, cache: ReplicaCache | None, inputs: tuple, target: Any, kwargs: dict) -> Any:
        self.check_placement(cache)
        self.finish_measurement()
        with_loss = self.loss_fn is not None and target is not None
        if target is not None:  # split like the inputs; without loss_fn it is the module's own keyword
            kwargs = {**kwargs, "target": target}
        batch_size = batch_size_of(inputs, kwargs, self.dim)
        if batch_size is None:  # nothing to split: run once on the primary device
            return self.run_once(inputs, kwargs, with_loss)
        plan = plan_split(batch_size, len(self.device_ids), self.split_for(batch_size))
        self.last_split_sizes = list(plan.sizes)
        hooks.split(self.module, self.device_ids, self.output_device, plan.sizes)
        with hooks.phase("scatter"):
            chunks = scatter(inputs, kwargs, plan, self.device_ids, self.dim)
        devices = self.last_devices = [device for device, _, _ in chunks]
        replicas = self.replicate_to(devices, with_loss, cache)
        # SyncBatchNorm layers meet across replicas
        has_sync = cache.has_sync_batchnorm if cache is not None else None
        synced = sync_batchnorm.synced_replicas(self.module, replicas, has_sync=has_sync)
        outputs = parallel_apply(
            synced,
            [a for _, a, _ in chunks],
            [k for _, _, k in chunks],
            devices,
            generators=self.randomness(self.module),
            # SyncBatchNorm's replicas wait for each other: side by side
            concurrency=THREADS if synced is not replicas else self.concurrency[SITE[self.module.training]],
        )
        if hooks.listening():
            self.announce_outputs(outputs, chunks)
        return self.combine(outputs, plan.sizes, with_loss, inputs, kwargs)

    def run_once(self, inputs: tuple, kwargs: dict, with_loss: bool) -> Any:
        self.last_split_sizes = None
        args, kw = unwrap_broadcasts(inputs, kwargs, self.primary_device)
        if with_loss and self.loss_fn is not None:  # (with_loss: there is a loss_fn and a target)
            return ReplicaWithLoss(self.module, self.loss_fn)(*args, **kw)
        return self.module(*args, **kw)

    def combine(
        self, outputs: list[Any], sizes: Sequence[int], with_loss: bool, inputs: tuple = (), kwargs: dict | None = None
    ) -> Any:
        """The batch's loss from the replicas' losses, or their outputs gathered on the output device."""
        if with_loss:
            with hooks.phase("loss", self.output_device):
                return combine_losses(outputs, [s for s in sizes if s > 0], self.loss_reduction, self.output_device)
        with hooks.phase("gather", self.output_device):
            return gather(
                outputs,
                self.output_device,
                self.dim,
                rows=[s for s in sizes if s > 0],
                input_sizes=sorted(other_sizes((inputs, kwargs or {}), self.dim)),
            )

    def split_for(self, batch_size: int) -> list[int] | None:
        """chunk_sizes, the balance planner's choice, or None for even."""
        if self.balancer is None:
            return self.chunk_sizes
        return self.balancer.chunk_sizes(batch_size, torch.is_grad_enabled() and self.training)

    def finish_measurement(self) -> None:
        """Let the balance planner close the step it measured (called at the start of every call)."""
        if self.balancer is not None:
            self.balancer.finish()

    def replicate_to(
        self, devices: list[torch.device], with_loss: bool, cache: ReplicaCache | None = None
    ) -> Sequence[Callable[..., Any]]:
        """A replica per device that has rows (with its loss when there is a target); from the cache when given."""
        primary = self.primary_device
        if cache is not None:
            replicas = cache.replicas(devices, primary)  # announces each device's "replicate" itself
        elif not hooks.listening():
            replicas = replicate(self.module, devices, primary)
        else:
            replicas = []
            for device in devices:  # one at a time, so a listener can charge each copy to its own device
                with hooks.phase("replicate", device):
                    replicas.extend(replicate(self.module, [device], primary))
        loss_fn = self.loss_fn
        if with_loss and loss_fn is not None:
            return [ReplicaWithLoss(replica, loss_fn) for replica in replicas]
        return replicas

    def announce_outputs(self, outputs: list[Any], chunks: list[tuple[torch.device, tuple, dict]]) -> None:
        """Tell listeners which device each replica's autograd nodes belong to (backward runs elsewhere)."""
        inputs = [leaf for _, args, kw in chunks for _, leaf in leaves((args, kw), "inputs")]
        stop = [t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        hooks.outputs(outputs, [device for device, _, _ in chunks], stop)

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.device_ids)
        extra = f", balance={self.balance!r}" if self.balance else ""
        return f"device_ids=[{devices}], output_device={self.output_device}, dim={self.dim}{extra}"
