"""The cost model: one training step of a profiled model, phase by phase, under each strategy.

Every phase is computation (FLOPs at the achieved rate), memory traffic (bytes at the device's memory
bandwidth), a transfer (alpha + bytes / beta over a link: the alpha-beta model), or host time to launch
kernels. The formulas, with their sources, are in docs/cost-model.md; this module is that page in code.

A strategy's phases and memory follow from its traits (dpkit.strategies.base.Traits), never from its
name: whether one process drives several replicas, whether they are copied every step or persist,
where the loss runs, whether it spans nodes. A new strategy is predicted from the traits it declares.

    hardware = Hardware(catalogue.gpu("h100-sxm"), catalogue.link("nvlink4"))
    prediction = predict(profile, hardware, "ddp", devices=8, batch_per_device=32)
    prediction.step_seconds, prediction.breakdown   # {"forward": ..., "all_reduce": ..., ...}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dpkit.plan.catalogue import GPU, Link
from dpkit.plan.profiles import FP32_BYTES, ModelProfile
from dpkit.strategies import (
    IN_REPLICAS,
    ON_ROOT,
    ONE_PROCESS,
    PER_DEVICE,
    PER_STEP,
    PERSISTENT,
    reference,
    strategy_class,
)

OPTIMIZER_STATE_BYTES_PER_PARAMETER = {"adam": 8, "sgd": 4}  # Adam: two moments; SGD: momentum
# bytes an optimizer step reads and writes per fp32 parameter with PyTorch's default (unfused, for-each)
# implementations, which make one pass over memory per elementwise operation: Adam's lerp, mul, addcmul,
# sqrt, div, add and addcdiv read 12 and write 7 tensors; SGD with momentum's mul, add, add read 5 and write 3
OPTIMIZER_TRAFFIC_BYTES_PER_PARAMETER = {"adam": 76, "sgd": 32}
PHASE_ORDER = (
    "scatter",
    "replicate",
    "forward",
    "launch",
    "gather",
    "loss",
    "backward",
    "reduce",
    "all_reduce",
    "optimizer",
    "overhead",
)


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
class CostConstants:
    """What the hardware's data sheet does not say; `dpkit plan --calibration` fits them to a bench run."""

    compute_efficiency: float = 0.45  # achieved / peak dense FLOP/s of a training step
    launch_seconds: float = 6e-6  # host time to launch one kernel from eager PyTorch
    step_overhead_seconds: float = 1e-3  # the Python of one step outside the kernels
    thread_seconds: float = 60e-6  # handing the replicas' threads their jobs and joining them (dp, replicated)
    bucket_bytes: int = 25 * 2**20  # DDP's default bucket_cap_mb
    memory_headroom: float = 0.9  # usable fraction of device memory (allocator, CUDA context)
    source: str = "defaults (docs/cost-model.md)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Prediction:
    strategy: str
    devices: int  # devices per node
    nodes: int
    batch_per_device: int
    step_seconds: float
    breakdown: dict[str, float]
    peak_bytes_per_device: list[int]
    max_batch_per_device: int
    samples_per_second: float = 0.0
    speedup: float = 0.0
    efficiency: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def total_devices(self) -> int:
        return self.devices * self.nodes

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "devices": self.devices,
            "nodes": self.nodes,
            "batch_size_per_device": self.batch_per_device,
            "step_seconds": self.step_seconds,
            "samples_per_second": self.samples_per_second,
            "speedup": self.speedup,
            "efficiency": self.efficiency,
            "peak_bytes_per_device": list(self.peak_bytes_per_device),
            "max_batch_size_per_device": self.max_batch_per_device,
            "breakdown": dict(self.breakdown),
            "notes": list(self.notes),
        }


# ---- the building blocks ------------------------------------------------------------------------


def transfer_seconds(link: Link, nbytes: float, messages: int = 1) -> float:
    """alpha-beta: each message pays the latency, the bytes pay the bandwidth."""
    if nbytes <= 0 and messages <= 0:
        return 0.0
    return messages * link.latency_seconds + nbytes / link.achieved_bytes_per_second


def root_fan_seconds(link: Link, nbytes: float, others: int) -> float:
    """Broadcast from, or reduce into, one root: the root's link carries one copy per other device."""
    return transfer_seconds(link, others * nbytes, others) if others > 0 else 0.0


def ring_all_reduce_seconds(link: Link, nbytes: float, devices: int, messages: int = 1) -> float:
    """Ring all-reduce: each device sends and receives 2(N-1)/N of the bytes in 2(N-1) steps."""
    if devices <= 1:
        return 0.0
    return (
        2 * (devices - 1) * messages * link.latency_seconds
        + 2 * (devices - 1) / devices * nbytes / link.achieved_bytes_per_second
    )


def precision_key(precision: str) -> str:
    return {"32": "32", "tf32": "tf32", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}.get(str(precision), "")


def achieved_flops(hardware: Hardware, precision: str, constants: CostConstants) -> float:
    key = precision_key(precision)
    if not key:
        raise ValueError(f"precision: expected 32, tf32, bf16-mixed or 16-mixed, got {precision!r}")
    peaks = hardware.gpu.peak_flops
    if key not in peaks:
        raise ValueError(f"precision: {hardware.gpu.name} has no peak figure for {key!r}; it has {', '.join(peaks)}")
    return peaks[key] * constants.compute_efficiency


# ---- one step -----------------------------------------------------------------------------------


def step_breakdown(
    profile: ModelProfile,
    hardware: Hardware,
    strategy: str,
    devices: int,
    batch_per_device: int,
    precision: str = "32",
    constants: CostConstants = CostConstants(),
    optimizer: str = "adam",
) -> dict[str, float]:
    """Seconds per phase of one step on the slowest device (device 0 under dp), as they add up."""
    traits = strategy_class(strategy).traits
    nodes = hardware.nodes
    total = devices * nodes
    local = devices
    shared = hardware.shared_compute
    rate = achieved_flops(hardware, precision, constants)
    # virtual CPU devices divide one pool of cores: beyond compute_slots devices, each runs slower
    crowding = max(1.0, total / hardware.compute_slots) if shared else 1.0
    rate_per_device = rate / crowding
    memory_rate = hardware.gpu.memory_bytes_per_second / crowding
    link = hardware.link
    B = batch_per_device
    params_bytes = profile.parameter_bytes
    forward_compute = B * profile.flops_per_sample / rate_per_device
    backward_compute = 2 * forward_compute
    forward_launch = profile.kernels_per_forward * constants.launch_seconds
    backward_launch = 2 * forward_launch
    threads = traits.threads_per_step
    per_step = traits.replicas == PER_STEP  # DataParallel: replicas copied from device 0 at every forward
    persistent = traits.replicas == PERSISTENT  # every replica keeps its copy and steps it with the summed gradient
    phases: dict[str, float] = {}

    # forward: under one process the replicas' threads take turns holding the GIL to launch kernels
    serial_launch = forward_launch * (local if threads else 1)
    if shared:  # nothing runs ahead of the host: launching and computing add up (every replica's, in turn)
        phases["forward"] = forward_compute
        phases["launch"] = serial_launch + (backward_launch * local if threads else backward_launch)
    else:
        # kernels queue ahead of the device; only launching slower than the device computes shows
        phases["forward"] = forward_compute
        phases["launch"] = max(0.0, serial_launch - forward_compute)
    # backward: autograd's device threads launch without the GIL (GPU); on CPU autograd runs every
    # replica's backward in the one calling thread, one after the other, except where the replicas persist
    # (replicated): they run their own backward in their own threads
    if shared and threads and per_step:
        phases["backward"] = local * 2 * B * profile.flops_per_sample / rate
    else:
        phases["backward"] = backward_compute if shared else max(backward_compute, backward_launch)

    others = total - 1
    if threads:  # one process loads the whole batch and sends every replica its rows
        phases["scatter"] = root_fan_seconds(link, B * profile.input_bytes_per_sample, others)
    if per_step:
        # DataParallel copies the parameters from device 0 to every replica at every step
        phases["replicate"] = (
            (
                root_fan_seconds(link, params_bytes, others)
                + total * (profile.parameter_tensors or 1) * constants.launch_seconds
            )
            if others
            else 0.0
        )
    output_bytes = B * profile.output_bytes_per_sample
    if per_step and traits.loss == ON_ROOT:  # the replicas' outputs gathered on device 0 for the loss
        phases["gather"] = root_fan_seconds(link, output_bytes, others)
        # the loss and its gradient over every replica's outputs, on device 0 alone (read, write, read)
        phases["loss"] = 3 * total * output_bytes / memory_rate
    else:
        phases["loss"] = 3 * output_bytes / memory_rate * (local if shared and threads else 1)
        if per_step and traits.loss == IN_REPLICAS:  # DataParallel gathers the replicas' losses only
            phases["gather"] = root_fan_seconds(link, FP32_BYTES, others)
    if per_step:
        # backward of the broadcast: every replica's gradients summed into device 0's
        phases["reduce"] = root_fan_seconds(link, params_bytes, others) + others * 3 * params_bytes / memory_rate
    # replicas that share host weights on virtual CPU devices (replicated): the sum is a reduce into replica
    # 0's weights in memory and the optimizer steps once; elsewhere every replica holds and steps its own copy
    shared_weights = traits.shares_host_weights and shared
    if shared_weights and total > 1:
        phases["all_reduce"] = others * 3 * params_bytes / memory_rate
    elif persistent and total > 1:
        phases["all_reduce"] = exposed_all_reduce_seconds(
            profile, hardware, strategy, devices, phases["backward"], constants
        )
    traffic = OPTIMIZER_TRAFFIC_BYTES_PER_PARAMETER[optimizer] * profile.parameters
    # one process whose replicas persist steps each replica's copy; a process per device steps its own one
    steps_in_process = local if traits.processes == ONE_PROCESS and persistent and not shared_weights else 1
    if not shared:
        optimizer_memory = traffic / memory_rate
    elif shared_weights:  # one step, its parameters split among the replicas' threads
        optimizer_memory = traffic / (hardware.gpu.memory_bytes_per_second * min(local, hardware.compute_slots))
    elif persistent:  # every replica steps its own copy at once
        optimizer_memory = traffic / memory_rate * steps_in_process
    else:  # one thread steps while the replicas' threads wait: nothing crowds it
        optimizer_memory = traffic / hardware.gpu.memory_bytes_per_second
    phases["optimizer"] = (
        optimizer_memory + steps_in_process * max(1, profile.parameter_tensors) * constants.launch_seconds / 4
    )  # foreach kernels
    # the replicas' threads are handed their jobs together and waited for together: about three hand-offs
    # a step (forward, backward, step or gather), each costing one thread's wake-up and join, not one per replica
    phases["overhead"] = constants.step_overhead_seconds + (
        constants.thread_seconds * 3 if threads and local > 1 else 0.0
    )
    return {name: phases[name] for name in PHASE_ORDER if name in phases and phases[name] > 0}


def all_reduce_link(hardware: Hardware, strategy: str) -> Link:
    """The link a gradient all-reduce is bound by: across nodes the slower of the node link and the
    network; between processes of one node the interprocess link where one is given."""
    link = hardware.link
    if strategy_class(strategy).traits.processes == PER_DEVICE and hardware.interprocess is not None:
        link = hardware.interprocess
    slower_network = (
        hardware.network is not None and hardware.network.achieved_bytes_per_second < link.achieved_bytes_per_second
    )
    if hardware.nodes > 1 and slower_network:
        link = hardware.network
    return link


def exposed_all_reduce_seconds(
    profile: ModelProfile,
    hardware: Hardware,
    strategy: str,
    devices: int,
    backward_seconds: float,
    constants: CostConstants,
) -> float:
    """DDP's bucketed ring all-reduce, started bucket by bucket while backward runs; what backward
    cannot hide is exposed: at least the last bucket, which is ready only when backward ends."""
    total = devices * hardware.nodes
    link = all_reduce_link(hardware, strategy)
    buckets = max(1, -(-profile.parameter_bytes // constants.bucket_bytes))
    whole = ring_all_reduce_seconds(link, profile.parameter_bytes, total, messages=buckets)
    if hardware.shared_compute:
        return whole  # one pool of cores: communication and computation take turns
    last_bucket = whole / buckets
    hidden_window = backward_seconds * (buckets - 1) / buckets
    return max(last_bucket, whole - hidden_window)


# ---- memory -------------------------------------------------------------------------------------


def memory_per_device(
    profile: ModelProfile,
    strategy: str,
    devices: int,
    batch_per_device: int,
    precision: str = "32",
    optimizer: str = "adam",
    shared_weights: bool = False,
) -> tuple[list[int], list[float]]:
    """(peak bytes per device, bytes per extra sample per device). Device 0 first.

    `shared_weights`: the devices are virtual CPU devices, on which a strategy that shares host weights
    (replicated) makes its replicas views of replica 0's weights, stepped once with one optimizer state:
    the other replicas hold only their gradients until the sum. Other strategies ignore it."""
    traits = strategy_class(strategy).traits
    params = profile.parameter_bytes
    grads = params
    state = OPTIMIZER_STATE_BYTES_PER_PARAMETER[optimizer] * profile.parameters
    activation_scale = 0.5 if precision in ("bf16-mixed", "16-mixed") else 1.0
    per_sample = profile.activation_bytes_per_sample * activation_scale + 2 * profile.output_bytes_per_sample
    replica_fixed = params + grads  # a replica's copy and its gradients, while the step runs
    slope = [per_sample] * devices
    if traits.replicas == PER_STEP:  # device 0 keeps the model and the optimizer state; the others a copy per step
        fixed = [params + grads + state] + [replica_fixed] * (devices - 1)
        if traits.loss == ON_ROOT and devices > 1:
            # gathered logits and their gradient (one device: DataParallel runs the module directly)
            slope[0] = per_sample + 2 * profile.output_bytes_per_sample * devices
    elif traits.shares_host_weights and shared_weights:
        fixed = [params + grads + state] + [grads] * (devices - 1)
    else:
        # DDP's gradient buckets are a second copy of the gradients in every process
        buckets = grads if traits.processes == PER_DEVICE and devices > 1 else 0
        fixed = [params + grads + state + buckets] * devices
    peaks = [int(f + s * batch_per_device) for f, s in zip(fixed, slope)]
    return peaks, slope


def largest_batch_per_device(
    profile: ModelProfile,
    hardware: Hardware,
    strategy: str,
    devices: int,
    precision: str,
    optimizer: str,
    constants: CostConstants,
) -> int:
    peaks_at_zero, slopes = memory_per_device(
        profile, strategy, devices, 0, precision, optimizer, shared_weights=hardware.shared_compute
    )
    usable = hardware.gpu.memory_bytes * constants.memory_headroom
    fits = [int((usable - fixed) // slope) if slope > 0 else 10**9 for fixed, slope in zip(peaks_at_zero, slopes)]
    return max(0, min(fits))


# ---- predictions --------------------------------------------------------------------------------


def predict(
    profile: ModelProfile,
    hardware: Hardware,
    strategy: str,
    devices: int,
    batch_per_device: int,
    precision: str = "32",
    constants: CostConstants = CostConstants(),
    optimizer: str = "adam",
) -> Prediction:
    if devices < 1:
        raise ValueError(f"devices: expected positive device counts, got {devices}")
    if batch_per_device < 1:
        raise ValueError(f"batch_per_device: expected at least 1, got {batch_per_device}")
    if optimizer not in OPTIMIZER_STATE_BYTES_PER_PARAMETER:
        raise ValueError(
            f"optimizer: expected one of {', '.join(OPTIMIZER_STATE_BYTES_PER_PARAMETER)}, got {optimizer!r}"
        )
    breakdown = step_breakdown(profile, hardware, strategy, devices, batch_per_device, precision, constants, optimizer)
    step = sum(breakdown.values())
    peaks, _ = memory_per_device(
        profile, strategy, devices, batch_per_device, precision, optimizer, shared_weights=hardware.shared_compute
    )
    largest = largest_batch_per_device(profile, hardware, strategy, devices, precision, optimizer, constants)
    samples = batch_per_device * devices * hardware.nodes
    prediction = Prediction(
        strategy,
        devices,
        hardware.nodes,
        batch_per_device,
        step,
        breakdown,
        peaks,
        largest,
        samples_per_second=samples / step,
    )
    if not hardware.shared_compute and max(peaks) > hardware.gpu.memory_bytes * constants.memory_headroom:
        prediction.notes.append(
            f"does not fit: {max(peaks) / 2**30:.1f} GiB on the fullest device, "
            f"{hardware.gpu.memory_bytes / 2**30:.0f} GiB on a {hardware.gpu.name}"
        )
    if hardware.link.max_devices is not None and devices > hardware.link.max_devices:
        prediction.notes.append(f"{hardware.link.name} joins at most {hardware.link.max_devices} devices")
    return prediction


def predict_all(
    profile: ModelProfile,
    hardware: Hardware,
    strategies: list[str],
    device_counts: list[int],
    batch_per_device: int,
    precision: str = "32",
    constants: CostConstants = CostConstants(),
    optimizer: str = "adam",
) -> list[Prediction]:
    """Every strategy at every device count it can use (only strategies with a process per device, such
    as ddp, span nodes), with speed-up and efficiency against the reference strategy on one device of one node."""
    baseline = predict(
        profile, replace(hardware, nodes=1), reference(), 1, batch_per_device, precision, constants, optimizer
    )
    predictions = []
    for strategy in strategies:
        traits = strategy_class(strategy).traits
        spans_nodes = traits.processes == PER_DEVICE  # a launcher's processes reach another node's devices
        one_device = traits.max_devices == 1  # the reference: predicted on one device of one node, as the baseline
        if hardware.nodes > 1 and not spans_nodes and not one_device:
            continue  # one process cannot drive another node's devices
        for devices in device_counts:
            if traits.max_devices is not None and devices > traits.max_devices:
                continue
            node_hardware = replace(hardware, nodes=hardware.nodes if spans_nodes and not one_device else 1)
            prediction = predict(
                profile, node_hardware, strategy, devices, batch_per_device, precision, constants, optimizer
            )
            prediction.speedup = prediction.samples_per_second / baseline.samples_per_second
            prediction.efficiency = prediction.speedup / prediction.total_devices
            predictions.append(prediction)
    return predictions
