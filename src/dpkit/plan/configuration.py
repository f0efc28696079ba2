"""What the cost model predicts for, as values: the hardware (devices, their link, the network, nodes), the batch
(per device, or one global batch split), and Setup, the one value every piece of the cost model takes (a profiled
model on that hardware under a strategy and its options, on so many devices, at a batch, a precision and an
optimizer); with the precision's figures (the achieved FLOP/s, what a sharded strategy gathers per parameter) and
the host's time per kernel launch.

    hardware = Hardware(catalogue.gpu("h100-sxm"), catalogue.link("nvlink4"))
    setup = Setup(profile, hardware, "fsdp", 8, 32, "bf16-mixed")
    setup.traits, setup.processes, setup.shard_size
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dpkit.plan.catalogue import GPU, Link
from dpkit.plan.constants import CostConstants
from dpkit.plan.profiles import FP32_BYTES, ModelProfile
from dpkit.strategies import Traits, strategy_traits
from dpkit.strategies.compression import Compression


@dataclass(frozen=True)
class Hardware:
    """Devices of one kind, the link between the devices of a node, and the network between nodes.

    `shared_compute`: the devices share one pool of compute (virtual CPU devices on one CPU), so
    adding devices divides the pool instead of adding to it, and nothing overlaps with anything.
    """

    gpu: GPU
    link: Link
    network: Link | None = None
    nodes: int = 1
    shared_compute: bool = False
    compute_slots: float = 1.0  # with shared_compute: devices that compute at full speed at once (free cores)
    interprocess: Link | None = None  # between processes on one node when it differs from `link` (gloo on loopback)


@dataclass(frozen=True)
class BatchSize:
    """The batch a plan is for: `samples` per device (`per_device`), or over all devices (global) and split
    across them, as DistributedSampler and scatter split a batch: on N devices the fullest one takes
    ceil(samples / N), and that share sets the step (the others wait for it at the gradient sum)."""

    samples: int
    per_device: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            name = "batch_per_device" if self.per_device else "batch_size"
            raise ValueError(f"{name}: expected a positive number of samples, got {self.samples!r}")

    def share(self, devices: int) -> int:
        """The fullest device's samples on `devices` devices in all."""
        return self.samples if self.per_device else -(-self.samples // devices)

    def total(self, devices: int) -> int:
        """The samples of one step on `devices` devices in all."""
        return self.samples * devices if self.per_device else self.samples

    def doubled(self) -> BatchSize:
        return BatchSize(2 * self.samples, self.per_device)

    def describe(self) -> str:
        return f"{self.samples} per device" if self.per_device else f"{self.samples} in all (split across the devices)"


def as_batch(batch: int | BatchSize) -> BatchSize:
    """A plain number is a batch per device."""
    return batch if isinstance(batch, BatchSize) else BatchSize(batch)


@dataclass(frozen=True)
class Setup:
    """One configuration to predict: a profiled model on `hardware`, a strategy (built with `options`) on `devices`
    per node, the fullest device's samples, the precision, the host's constants and the optimizer; `offload`: the
    sharded parts of the state kept in host memory (CPU offload); `compression`: the gradients' on the link (one the
    strategy takes, Traits.compressions; PowerSGD as it runs after its warm-up); `accumulate`: micro-batches of
    `batch_per_device` samples per optimizer step, the gradient exchange once per step."""

    profile: ModelProfile
    hardware: Hardware
    strategy: str
    devices: int
    batch_per_device: int
    precision: str = "32"
    constants: CostConstants = CostConstants()
    optimizer: str = "adam"
    options: Mapping[str, Any] = field(default_factory=dict)
    offload: bool = False
    compression: Compression = Compression()
    accumulate: int = 1

    @property
    def traits(self) -> Traits:
        return strategy_traits(self.strategy, **self.options)

    @property
    def processes(self) -> int:
        """Devices in all, over every node."""
        return self.devices * self.hardware.nodes

    @property
    def shard_size(self) -> int:
        """The processes one shard group spans (1 when the strategy shards nothing)."""
        return self.traits.shard_size(self.processes, self.devices)

    @property
    def replicas_of_a_shard(self) -> int:
        """Shard groups holding the same shards (hybrid sharding: the mesh's replicate dimension)."""
        return max(1, self.processes // self.shard_size)

    @property
    def gradient_buckets(self) -> int:
        """The buckets DDP's exchange splits the float32 gradients into (CostConstants.bucket_bytes each)."""
        return max(1, -(-self.profile.parameter_bytes // self.constants.bucket_bytes))

    def with_batch(self, batch_per_device: int) -> Setup:
        return replace(self, batch_per_device=batch_per_device)


def precision_key(precision: str) -> str:
    return {"32": "32", "tf32": "tf32", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}.get(str(precision), "")


def mixed_precision(precision: str) -> bool:
    """Autocast to a 16-bit dtype: activations halve, weights get 16-bit copies."""
    return precision_key(precision) in ("bf16-mixed", "16-mixed")


def runs_at(strategy: str, precision: str, options: Mapping[str, Any] | None = None) -> bool:
    """Whether the strategy trains at this precision: 16-mixed needs a GradScaler, which not all support."""
    return precision_key(precision) != "16-mixed" or strategy_traits(strategy, **(options or {})).grad_scaler


def gathered_bytes_per_parameter(precision: str) -> int:
    """What a sharded strategy gathers per parameter: its param_dtype, 16-bit under mixed precision."""
    return 2 if mixed_precision(precision) else FP32_BYTES


def achieved_flops(hardware: Hardware, precision: str, constants: CostConstants) -> float:
    key = precision_key(precision)
    if not key:
        raise ValueError(f"precision: expected 32, tf32, bf16-mixed or 16-mixed, got {precision!r}")
    peaks = hardware.gpu.peak_flops
    if key not in peaks:
        raise ValueError(f"precision: {hardware.gpu.name} has no peak figure for {key!r}; it has {', '.join(peaks)}")
    return peaks[key] * constants.compute_efficiency


def kernel_launch_seconds(hardware: Hardware, constants: CostConstants) -> float:
    """Host time per kernel launch: a calibration's fitted figure, else the catalogue's for the GPU, else the
    constants' default."""
    if "launch_seconds" in constants.fitted or hardware.gpu.launch_seconds is None:
        return constants.launch_seconds
    return hardware.gpu.launch_seconds
