"""Each device's memory at the step's peak, by category, as the strategy's traits keep, shard and gather the
state; the largest batch that fits; and Sizing, the memory questions a plan's predictions do not answer (on how
many devices a strategy fits, how large a batch, what CPU offload leaves on a device).

    memory_by_category(setup)[0]   # {"parameters": ..., "gradients": ..., "optimizer_state": ..., ...}
    peaks, slopes = memory_per_device(setup)   # bytes per device, and per extra sample
"""

from __future__ import annotations

from dataclasses import dataclass

from dpkit.plan.configuration import BatchSize, Hardware, Setup, as_batch, gathered_bytes_per_parameter, mixed_precision
from dpkit.plan.constants import (
    AUTOCAST_COPY_BYTES_PER_PARAMETER,
    OPTIMIZER_STATE_BYTES_PER_PARAMETER,
    PREFETCHED_UNITS,
    REDUCE_SCATTER_BYTES_PER_PARAMETER,
    CostConstants,
)
from dpkit.plan.profiles import FP32_BYTES, ModelProfile
from dpkit.strategies import ON_ROOT, PER_DEVICE, PER_STEP, PER_UNIT, SHARDED, WHOLE, strategy_class

MOST_DEVICES = 1 << 16  # the most devices `smallest_fitting_devices` looks at

# what memory_by_category counts, named as dpkit profile books it (dpkit.observe.memory.CATEGORIES) where it can be
MEMORY_CATEGORIES = (
    "parameters",  # the weights this process keeps between steps (whole, or its shards)
    "gradients",  # the gradients it holds after the exchange (whole, or its shards)
    "optimizer_state",  # its optimizer state (whole, or its shards)
    "gathered_parameters",  # sharded weights gathered whole to compute, and a unit's whole gradient before its
    # reduce-scatter
    "gradient_buckets",  # DDP's buckets: a second copy of whole gradients, for the all-reduce
    "autocast_copies",  # mixed precision: autocast's 16-bit copy of each whole weight, kept for backward
    "compression_state",  # PowerSGD: its error feedback (a float32 copy of the gradients) and one bucket's copy
    "activations",  # saved for backward, and the outputs with their gradient: per sample
    "gathered_outputs",  # the replicas' outputs gathered on device 0 for the loss (dp): per sample
)


def state_bytes_per_parameter(optimizer: str) -> dict[str, int]:
    """Bytes per parameter of each part of the state a whole copy keeps: float32 weights and gradients under
    every precision (autocast keeps them so, and so do a sharded strategy's shards) and the optimizer's state.
    With Adam 4 + 4 + 8 = 16, the same 16 as ZeRO's 2 + 2 + 12 for mixed precision (Rajbhandari et al. 2020,
    section 3.1), which counts the float32 master copy with the optimizer state (K = 12) and 16-bit weights and
    gradients instead."""
    return {
        "parameters": FP32_BYTES,
        "gradients": FP32_BYTES,
        "optimizer_state": OPTIMIZER_STATE_BYTES_PER_PARAMETER[optimizer],
    }


def memory_by_category(setup: Setup) -> list[dict[str, int]]:
    """Each device's bytes at the step's peak by category (MEMORY_CATEGORIES), device 0 first, at the setup's
    batch. A part of the state the traits shard is 1/S of the whole on each of the S processes of its shard group
    (none on the device with `offload`); a whole part is all of it:

        per device  ddp 16Ψ   ZeRO-1 8Ψ + 8Ψ/N   ZeRO-2 4Ψ + 12Ψ/N   ZeRO-3 (fsdp) 16Ψ/N   hsdp 16Ψ/S

    (Adam, float32 weights and gradients: the ZeRO paper's 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N with the float32
    master weights counted as dpkit keeps them), plus what is gathered, the autocast copies and the activations.

    On virtual CPU devices (`hardware.shared_compute`) a strategy that shares host weights (replicated) makes its
    replicas views of replica 0's weights, stepped once with one optimizer state: the other replicas hold only
    their gradients until the sum."""
    root, other = _root_and_other(setup)
    return [root] + [dict(other) for _ in range(setup.devices - 1)]


def _root_and_other(setup: Setup) -> tuple[dict[str, int], dict[str, int]]:
    """memory_by_category's device 0 and any other device (all the others hold the same): the advisor asks for up
    to thousands of devices."""
    profile, traits = setup.profile, setup.traits
    mixed = mixed_precision(setup.precision)
    # autocast's 16-bit copies of the whole weights, held from forward until backward used them (gathered units are
    # 16-bit already)
    autocast = AUTOCAST_COPY_BYTES_PER_PARAMETER * profile.parameters if mixed and traits.weights == WHOLE else 0
    # DDP's gradient buckets are a second copy of the whole gradients in every process
    whole_gradients = traits.processes == PER_DEVICE and traits.gradients == WHOLE and setup.processes > 1
    activation_scale = 0.5 if mixed else 1.0
    per_sample = profile.activation_bytes_per_sample * activation_scale + 2 * profile.output_bytes_per_sample
    batch = setup.batch_per_device
    first = {
        **kept_state_bytes(setup),
        "gathered_parameters": gathered_bytes(setup),
        "gradient_buckets": FP32_BYTES * profile.parameters if whole_gradients else 0,
        "autocast_copies": autocast,
        "compression_state": compression_state_bytes(setup),
        "activations": per_sample * batch,
        "gathered_outputs": 0.0,
    }
    root, other = dict(first), dict(first)
    if traits.replicas == PER_STEP:  # device 0 keeps the model and the optimizer state; the others a copy per step
        other["optimizer_state"] = 0
        if traits.loss == ON_ROOT and setup.devices > 1:
            # gathered logits and their gradient (one device: DataParallel runs the module directly)
            root["gathered_outputs"] = 2 * profile.output_bytes_per_sample * setup.devices * batch
    elif traits.shares_host_weights and setup.hardware.shared_compute:
        other["parameters"] = other["optimizer_state"] = 0
    return {name: int(root[name]) for name in MEMORY_CATEGORIES}, {name: int(other[name]) for name in MEMORY_CATEGORIES}


def compression_state_bytes(setup: Setup) -> float:
    """What a low-rank compression keeps beside the gradients (torch's powerSGD_hook): the error feedback, a float32
    copy of every gradient element kept between steps, and, while a bucket is compressed, a copy of it; the P and Q
    factors are small beside them. A 16-bit cast holds one bucket's 16-bit copy at a time, left out."""
    compression = setup.compression
    if not compression.compresses or compression.wire_dtype is not None or setup.processes <= 1:
        return 0.0
    return FP32_BYTES * setup.profile.parameters + min(setup.constants.bucket_bytes, setup.profile.parameter_bytes)


def kept_state_bytes(setup: Setup) -> dict[str, float]:
    """What one process keeps of each part of the state between steps: all of a whole part; 1/S of a part the
    traits shard over a group of S processes (none on the device with `offload`)."""
    traits = setup.traits
    sharding = {"parameters": traits.weights, "gradients": traits.gradients, "optimizer_state": traits.optimizer_state}
    group = setup.shard_size
    kept: dict[str, float] = {}
    for part, per_parameter in state_bytes_per_parameter(setup.optimizer).items():
        whole = per_parameter * setup.profile.parameters
        if sharding[part] == SHARDED:
            kept[part] = 0.0 if setup.offload else whole / group
        else:
            kept[part] = float(whole)
    return kept


def gathered_bytes(setup: Setup) -> float:
    """Sharded weights gathered whole to compute, in the param dtype (16-bit under mixed precision): the largest
    unit and the next one, prefetched (Traits.gathers PER_UNIT), or every unit kept from forward to backward (the
    whole model); and where the gradients are sharded, a unit's whole gradient before its reduce-scatter."""
    profile, traits = setup.profile, setup.traits
    unit = profile.unit_parameters
    gathered = 0.0
    if traits.weights == SHARDED:
        prefetched = PREFETCHED_UNITS if profile.units > 1 else 0
        held = (1 + prefetched) * unit if traits.gathers == PER_UNIT else profile.parameters
        gathered += held * gathered_bytes_per_parameter(setup.precision)
    if traits.gradients == SHARDED:
        gathered += unit * REDUCE_SCATTER_BYTES_PER_PARAMETER
    return gathered


def memory_per_device(setup: Setup) -> tuple[list[int], list[float]]:
    """(peak bytes per device, bytes per extra sample per device), device 0 first: memory_by_category added up."""
    # device 0 and one other stand for all: every device after the first holds the same
    at_zero = _root_and_other(setup.with_batch(0))
    at_one = _root_and_other(setup.with_batch(1))
    slopes = [float(sum(one.values()) - sum(zero.values())) for zero, one in zip(at_zero, at_one)]
    peaks = [int(sum(zero.values()) + slope * setup.batch_per_device) for zero, slope in zip(at_zero, slopes)]
    others = setup.devices - 1
    return peaks[:1] + peaks[1:] * others, slopes[:1] + slopes[1:] * others


def largest_batch_per_device(setup: Setup) -> int:
    """The most samples per device that fit the usable memory."""
    peaks_at_zero, slopes = memory_per_device(setup.with_batch(0))
    usable = setup.hardware.gpu.memory_bytes * setup.constants.memory_headroom
    fits = [int((usable - fixed) // slope) if slope > 0 else 10**9 for fixed, slope in zip(peaks_at_zero, slopes)]
    return max(0, min(fits))


@dataclass(frozen=True)
class Sizing:
    """The memory questions a plan's predictions do not answer, for the advisor when little or nothing fits:
    on how many devices a strategy would fit, how large a batch fits, what CPU offload leaves on a device.

    Device counts are per node (`hardware.nodes` of them); a sharded strategy splits over them all."""

    profile: ModelProfile
    hardware: Hardware
    batch_per_device: int | BatchSize
    precision: str = "32"
    optimizer: str = "adam"
    constants: CostConstants = CostConstants()

    @property
    def usable_bytes(self) -> float:
        return self.hardware.gpu.memory_bytes * self.constants.memory_headroom

    def share(self, devices: int) -> int:
        """The fullest device's samples on `devices` devices per node (a global batch shrinks with more)."""
        return as_batch(self.batch_per_device).share(devices * self.hardware.nodes)

    def setup(self, strategy: str, devices: int, offload: bool = False, batch: int | None = None) -> Setup:
        return Setup(
            self.profile,
            self.hardware,
            strategy,
            devices,
            self.share(devices) if batch is None else batch,
            self.precision,
            self.constants,
            self.optimizer,
            offload=offload,
        )

    def peak_bytes(self, strategy: str, devices: int, offload: bool = False, batch: int | None = None) -> int:
        """The fullest device's peak."""
        return max(memory_per_device(self.setup(strategy, devices, offload, batch))[0])

    def fits(self, strategy: str, devices: int, offload: bool = False) -> bool:
        return self.hardware.shared_compute or self.peak_bytes(strategy, devices, offload) <= self.usable_bytes

    def smallest_fitting_devices(self, strategy: str, most: int = MOST_DEVICES) -> int | None:
        """The fewest devices per node on which `strategy` fits at this batch (None: not up to `most`). For a
        strategy whose fullest device holds less on more devices (a sharded one): doubling, then bisection."""
        most = min(most, strategy_class(strategy).traits.max_devices or most)
        if self.fits(strategy, 1):
            return 1
        low, high = 1, 2  # low does not fit; look for a high that does
        while high <= most and not self.fits(strategy, high):
            low, high = high, high * 2
        if high > most:
            if low == most or not self.fits(strategy, most):
                return None
            high = most
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if self.fits(strategy, middle) else (middle, high)
        return high

    def largest_batch(self, strategy: str, devices: int, offload: bool = False) -> int:
        return largest_batch_per_device(self.setup(strategy, devices, offload, batch=0))
