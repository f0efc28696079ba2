"""The cost model: one training step of a profiled model, phase by phase, under each strategy.

Every phase is computation (FLOPs at the achieved rate), memory traffic (bytes at the device's memory
bandwidth), a transfer (alpha + bytes / beta over a link: the alpha-beta model), or host time: launching
kernels (the catalogue's figure per GPU), DataParallel re-making its replicas per module and per parameter tensor
at every step, handing the replica threads their work, the replica threads of one process taking turns on the
GIL (CostConstants; a calibration fits them). The formulas, with their sources, are in docs/cost-model.md;
this module is that page in code.

A strategy's phases and memory follow from its traits (dpkit.strategies.base.Traits), never from its
name: whether one process drives several replicas, whether they are copied every step or persist,
where the loss runs, whether it spans nodes, which parts of its state (weights, gradients, optimizer state) it
shards over which group of processes, and how it gathers sharded weights. A new strategy is predicted from the
traits it declares (with its options: Strategy.traits_for).

    hardware = Hardware(catalogue.gpu("h100-sxm"), catalogue.link("nvlink4"))
    prediction = predict(profile, hardware, "ddp", devices=8, batch_per_device=32)
    prediction.step_seconds, prediction.breakdown   # {"forward": ..., "all_reduce": ..., ...}
    setup = Setup(profile, hardware, "fsdp", 8, 32, "bf16-mixed")   # the one value the pieces below take
    memory_by_category(setup)[0]   # {"parameters": ..., "gradients": ..., "optimizer_state": ..., ...}
"""

from __future__ import annotations

from collections.abc import Mapping
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
    PER_UNIT,
    PERSISTENT,
    SHARDED,
    WHOLE,
    Traits,
    reference,
    strategy_class,
    strategy_traits,
)

OPTIMIZER_STATE_BYTES_PER_PARAMETER = {"adam": 8, "adamw": 8, "sgd": 4}  # Adam(W): two moments; SGD: momentum
# Parameters and gradients are float32 under every precision (autocast keeps them so; the sharded strategy's
# shards and their gradients are float32 too): with Adam 4 + 4 + 8 = 16 bytes per parameter, the same 16 as
# ZeRO's 2 + 2 + 12 for mixed precision (Rajbhandari et al. 2020, section 3.1), which counts the float32
# master copy with the optimizer state and 16-bit parameters and gradients instead.
# Under mixed precision autocast also keeps a 16-bit copy of every weight a matmul or convolution uses, from
# the cast in forward until backward has used it (saved for backward): 2 bytes per parameter, unsharded.
AUTOCAST_COPY_BYTES_PER_PARAMETER = 2
# A sharded strategy (fsdp: FSDP2 with MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) under
# bf16-mixed) gathers each unit's parameters in 16 bits under mixed precision (4 bytes otherwise), computes the
# unit's whole gradient in that dtype and reduce-scatters it in float32.
REDUCE_SCATTER_BYTES_PER_PARAMETER = FP32_BYTES
PREFETCHED_UNITS = 1  # FSDP2 keeps one more unit's all-gather in flight, in forward and in backward
SHARDED_KERNELS_PER_COLLECTIVE = 3  # per unit and collective: copy-in, the collective, copy-out
MOST_DEVICES = 1 << 16  # the most devices `smallest_fitting_devices` looks at
# bytes an optimizer step reads and writes per fp32 parameter with PyTorch's default (unfused, for-each)
# implementations, which make one pass over memory per elementwise operation: Adam's lerp, mul, addcmul,
# sqrt, div, add and addcdiv read 12 and write 7 tensors; AdamW decays the weights first (a mul: one more read
# and write); SGD with momentum's mul, add, add read 5 and write 3
OPTIMIZER_TRAFFIC_BYTES_PER_PARAMETER = {"adam": 76, "adamw": 84, "sgd": 32}
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
    "all_gather",
    "reduce_scatter",
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
    # host time to launch one kernel from eager PyTorch; on a GPU of the catalogue its own figure
    # (hardware.json's launch_seconds) is used instead, unless a calibration fitted this one
    launch_seconds: float = 6e-6
    step_overhead_seconds: float = 1e-3  # the Python of one step outside the kernels
    thread_seconds: float = 60e-6  # handing the replicas' threads their jobs and joining them (dp, replicated)
    # DataParallel re-makes its replicas at every step, in Python, in the calling thread: per module of each
    # replica (a new module object, its dicts copied) and per parameter tensor of each replica (the alias or
    # copy, its autograd edge back to the original)
    module_seconds: float = 8e-6
    tensor_seconds: float = 4e-6
    # how one process's replica threads serialise on Python's GIL: N threads launching L seconds' worth of kernels
    # each take at least N x gil_share x L together (1: taking turns; above 1: contending for the GIL costs more
    # than taking turns). 1.5 is about what benchmarks/launch_bound_prediction.py fits on virtual CPU devices
    # (1.5 to 2.3 on a 2-core machine); a calibration fits it for the machine at hand
    gil_share: float = 1.5
    bucket_bytes: int = 25 * 2**20  # DDP's default bucket_cap_mb
    # host time of a sharded unit's hooks, once in forward and once in backward (FSDP2's pre/post-forward and
    # pre/post-backward: copy-in, waits, copy-out): an estimate, see docs/cost-model.md
    unit_seconds: float = 100e-6
    memory_headroom: float = 0.9  # usable fraction of device memory (allocator, CUDA context)
    source: str = "defaults (docs/cost-model.md)"
    fitted: tuple[str, ...] = ()  # the constants a calibration fitted: they win over the catalogue's figures

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["fitted"] = list(self.fitted)
        return data


def kernel_launch_seconds(hardware: Hardware, constants: CostConstants) -> float:
    """Host time per kernel launch: a calibration's fitted figure, else the catalogue's for the GPU, else the
    constants' default."""
    if "launch_seconds" in constants.fitted or hardware.gpu.launch_seconds is None:
        return constants.launch_seconds
    return hardware.gpu.launch_seconds


def threaded_launch_seconds(
    launch: float, compute: float, threads: int, crowding: float, shared: bool, gil_share: float
) -> float:
    """Host launch time that `threads` replica threads of one process add to a phase whose computing takes
    `compute` seconds (already crowded), each thread launching `launch` seconds' worth of kernels.

    The GIL-held share of launching is serialised among the threads (threads x gil_share x launch); on a GPU
    the rest runs in parallel on the host's cores and hides behind the devices' computing; on virtual CPU
    devices launching and computing share the cores (crowded like the computing) and add up."""
    gil_bound = threads * gil_share * launch
    if shared:
        return max(gil_bound - compute, launch * crowding)
    return max(0.0, max(gil_bound, launch) - compute)


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


@dataclass
class Prediction:
    strategy: str
    devices: int  # devices per node
    nodes: int
    batch_per_device: int  # the fullest device's samples
    step_seconds: float
    breakdown: dict[str, float]
    peak_bytes_per_device: list[int]
    max_batch_per_device: int
    samples_per_second: float = 0.0
    speedup: float = 0.0
    efficiency: float = 0.0
    notes: list[str] = field(default_factory=list)
    fits: bool = True  # the fullest device's peak within the usable memory
    runs: bool = True  # the strategy supports the precision (16-mixed needs a GradScaler)
    global_batch: int | None = None  # the samples of one step in all (None: batch_per_device on every device)
    options: dict[str, Any] = field(default_factory=dict)  # the strategy's options it was predicted with

    @property
    def total_devices(self) -> int:
        return self.devices * self.nodes

    @property
    def batch(self) -> int:
        """The samples of one step, over every device."""
        return self.global_batch if self.global_batch is not None else self.batch_per_device * self.total_devices

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "devices": self.devices,
            "nodes": self.nodes,
            "batch_size": self.batch,
            "batch_size_per_device": self.batch_per_device,
            "step_seconds": self.step_seconds,
            "samples_per_second": self.samples_per_second,
            "speedup": self.speedup,
            "efficiency": self.efficiency,
            "peak_bytes_per_device": list(self.peak_bytes_per_device),
            "max_batch_size_per_device": self.max_batch_per_device,
            "fits": self.fits,
            "runs": self.runs,
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


def ring_all_gather_seconds(link: Link, nbytes: float, devices: int, messages: int = 1) -> float:
    """Ring all-gather of `nbytes` in all (each device holds 1/N), or its mirror, the reduce-scatter: each
    device sends and receives (N-1)/N of the bytes in N-1 steps, half an all-reduce."""
    if devices <= 1:
        return 0.0
    return (devices - 1) * messages * link.latency_seconds + (
        devices - 1
    ) / devices * nbytes / link.achieved_bytes_per_second


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


# ---- what is predicted: one value -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """One configuration to predict: a profiled model on `hardware`, a strategy (built with `options`) on `devices`
    per node, the fullest device's samples, the precision, the host's constants and the optimizer; `offload`: the
    sharded parts of the state kept in host memory (CPU offload)."""

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

    def with_batch(self, batch_per_device: int) -> Setup:
        return replace(self, batch_per_device=batch_per_device)


# ---- one step -----------------------------------------------------------------------------------


def step_breakdown(setup: Setup) -> dict[str, float]:
    """Seconds per phase of one step on the slowest device (device 0 under dp), as they add up."""
    profile, hardware, constants, precision = setup.profile, setup.hardware, setup.constants, setup.precision
    traits = setup.traits
    total = setup.processes
    local = setup.devices
    shared = hardware.shared_compute
    rate = achieved_flops(hardware, precision, constants)
    # virtual CPU devices divide one pool of cores: beyond compute_slots devices, each runs slower
    crowding = max(1.0, total / hardware.compute_slots) if shared else 1.0
    rate_per_device = rate / crowding
    memory_rate = hardware.gpu.memory_bytes_per_second / crowding
    link = hardware.link
    B = setup.batch_per_device
    params_bytes = profile.parameter_bytes
    # arithmetic at the achieved rate, plus the memory passes of the operations FLOP counts leave out (the
    # elementwise ones: activations, normalizations, the loss's softmax), about a write of what forward saves for
    # backward and of the outputs, read and written again in backward
    activation_scale = 0.5 if mixed_precision(precision) else 1.0
    traffic_per_sample = profile.activation_bytes_per_sample * activation_scale + profile.output_bytes_per_sample
    forward_compute = B * (profile.flops_per_sample / rate_per_device + traffic_per_sample / memory_rate)
    backward_compute = 2 * forward_compute
    gathers_units = traits.weights == SHARDED and setup.shard_size > 1
    # a strategy that gathers sharded weights runs hooks per unit and launches its collectives' kernels: a gather
    # per unit in forward, in backward a reduce-scatter per unit and a gather where forward dropped the unit
    units = profile.units if gathers_units else 0
    collective_kernels = SHARDED_KERNELS_PER_COLLECTIVE * units
    launch_seconds = kernel_launch_seconds(hardware, constants)
    forward_launch = (profile.kernels_per_forward + collective_kernels) * launch_seconds
    forward_launch += units * constants.unit_seconds
    backward_launch = 2 * (profile.kernels_per_forward + collective_kernels) * launch_seconds
    backward_launch += units * constants.unit_seconds
    threads = traits.threads_per_step
    per_step = traits.replicas == PER_STEP  # DataParallel: replicas copied from device 0 at every forward
    persistent = traits.replicas == PERSISTENT  # every replica keeps its copy and steps it with the summed gradient
    phases: dict[str, float] = {}

    # forward: under one process the replicas' threads take turns holding the GIL to launch kernels; on a GPU
    # kernels queue ahead of the device and only launching slower than the device computes shows; on virtual
    # CPU devices nothing runs ahead of the host: launching and computing add up
    phases["forward"] = forward_compute
    if threads and local > 1:
        forward_host = threaded_launch_seconds(
            forward_launch, forward_compute, local, crowding, shared, constants.gil_share
        )
    elif shared:
        forward_host = forward_launch * crowding  # a process per device: each launches its own, on shared cores
    else:
        forward_host = max(0.0, forward_launch - forward_compute)
    # backward: autograd's device threads launch without the GIL (GPU); on CPU autograd runs every replica's
    # backward in the one calling thread, one after the other (launches and computing), except where the
    # replicas persist (replicated): they run their own backward in their own threads, as in forward
    backward_host = 0.0
    if shared and threads and per_step:
        memory_alone = hardware.gpu.memory_bytes_per_second
        phases["backward"] = local * 2 * B * (profile.flops_per_sample / rate + traffic_per_sample / memory_alone)
        backward_host = local * backward_launch
    elif shared and threads and local > 1:
        phases["backward"] = backward_compute
        backward_host = threaded_launch_seconds(
            backward_launch, backward_compute, local, crowding, shared, constants.gil_share
        )
    elif shared:
        phases["backward"] = backward_compute
        backward_host = backward_launch * crowding
    else:
        phases["backward"] = max(backward_compute, backward_launch)
    phases["launch"] = forward_host + backward_host

    others = total - 1
    if threads:  # one process loads the whole batch and sends every replica its rows
        phases["scatter"] = root_fan_seconds(link, B * profile.input_bytes_per_sample, others)
    if per_step:
        # DataParallel copies the parameters from device 0 to every replica at every step
        # and re-makes every replica's modules and parameter tensors in Python (the first replica's too)
        # (on one device too: dpkit's DataParallel still makes its one replica)
        phases["replicate"] = root_fan_seconds(link, params_bytes, others) + total * (
            profile.module_count * constants.module_seconds
            + max(1, profile.parameter_tensors) * constants.tensor_seconds
        )
    output_bytes = B * profile.output_bytes_per_sample
    if per_step and traits.loss == ON_ROOT:  # the replicas' outputs gathered on device 0 for the loss
        if shared:
            # one memory: the gather writes every replica's rows, device 0's included, into a new tensor (on one
            # device too), at the in-process copy rate
            phases["gather"] = transfer_seconds(link, total * output_bytes, others)
        else:
            phases["gather"] = root_fan_seconds(link, output_bytes, others)
        # the loss and its gradient over every replica's outputs, on device 0 alone (read, write, read)
        phases["loss"] = 3 * total * output_bytes / memory_rate
    else:
        # each replica's loss in its own thread (crowded like the computing); where the replicas are re-made every
        # step (dp-balanced) on virtual CPU devices, the losses' backward runs with the rest, serially
        phases["loss"] = 3 * output_bytes / memory_rate * (local if shared and threads and per_step else 1)
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
        phases.update(exposed_collective_seconds(setup, phases["forward"], phases["backward"]))
    traffic: float = OPTIMIZER_TRAFFIC_BYTES_PER_PARAMETER[setup.optimizer] * profile.parameters
    if traits.optimizer_state == SHARDED:
        traffic /= setup.shard_size  # each process steps its shard
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
        optimizer_memory + steps_in_process * max(1, profile.parameter_tensors) * launch_seconds / 4
    )  # foreach kernels
    # the replicas' threads are handed their jobs together and waited for together: about three hand-offs
    # a step (forward, backward, step or gather), each costing one thread's wake-up and join, not one per replica
    phases["overhead"] = constants.step_overhead_seconds + (
        constants.thread_seconds * 3 if threads and local > 1 else 0.0
    )
    return {name: phases[name] for name in PHASE_ORDER if name in phases and phases[name] > 0}


# ---- communication: what the traits shard decides the collectives ---------------------------------------------


def shard_group_link(setup: Setup) -> Link:
    """The link a shard group's gathers and reduce-scatters cross: the node's, unless the group spans nodes."""
    link = setup.hardware.link
    if setup.traits.processes == PER_DEVICE and setup.hardware.interprocess is not None:
        link = setup.hardware.interprocess
    return link if setup.shard_size <= setup.devices else collective_link(setup)


def collective_link(setup: Setup) -> Link:
    """The link a collective over every process is bound by: across nodes the slower of the node link and the
    network; between processes of one node the interprocess link where one is given."""
    hardware = setup.hardware
    link = hardware.link
    if setup.traits.processes == PER_DEVICE and hardware.interprocess is not None:
        link = hardware.interprocess
    network = hardware.network
    if (
        hardware.nodes > 1
        and network is not None
        and network.achieved_bytes_per_second < link.achieved_bytes_per_second
    ):
        link = network
    return link


def exposed_collective_seconds(setup: Setup, forward_seconds: float, backward_seconds: float) -> dict[str, float]:
    """The exposed seconds of the gradient exchange (and of the gathers) by phase, as the traits shard the state
    (Rajbhandari et al. 2020, section 7): nothing sharded, an all-reduce of the gradients (2Ψ per device); the
    optimizer state or the gradients sharded over whole weights (ZeRO-1/2), a reduce-scatter of the gradients
    and an all-gather of the updated weights (Ψ + Ψ); the weights sharded, their all-gathers (in forward, and
    again in backward where forward drops the units: ZeRO-3, 3Ψ with the reduce-scatter). Across the replicas
    of a shard (hybrid sharding) the shards' gradients are all-reduced too."""
    traits = setup.traits
    if not traits.sharded or setup.shard_size <= 1:  # whole replicas (a shard group of one is one too)
        return {"all_reduce": exposed_all_reduce_seconds(setup, backward_seconds)} if setup.processes > 1 else {}
    phases: dict[str, float]
    if traits.weights == SHARDED:
        gather, scatter = exposed_sharded_seconds(setup, forward_seconds, backward_seconds)
        phases = {"all_gather": gather, "reduce_scatter": scatter}
    else:
        phases = exposed_zero_seconds(setup, backward_seconds)
    replicas = setup.replicas_of_a_shard
    if replicas > 1:
        # each shard's gradient summed with its replicas' in the other groups, shard by shard as backward produces
        # them: what backward cannot hide shows, at least the last unit's. The groups' rings run at once; across
        # nodes they share each node's network link, which then carries the whole gradient's worth
        profile, hardware = setup.profile, setup.hardware
        link = collective_link(setup)
        shared_network = hardware.nodes > 1 and link is hardware.network
        nbytes = profile.parameter_bytes / (1 if shared_network else setup.shard_size)
        across = ring_all_reduce_seconds(link, nbytes, replicas, messages=profile.units)
        if hardware.shared_compute:
            phases["all_reduce"] = across
        else:
            share = profile.unit_parameters / profile.parameters
            phases["all_reduce"] = max(across * share, across - backward_seconds * (1 - share))
    return phases


def exposed_all_reduce_seconds(setup: Setup, backward_seconds: float) -> float:
    """DDP's bucketed ring all-reduce, started bucket by bucket while backward runs; what backward
    cannot hide is exposed: at least the last bucket, which is ready only when backward ends."""
    profile, constants = setup.profile, setup.constants
    buckets = max(1, -(-profile.parameter_bytes // constants.bucket_bytes))
    whole = ring_all_reduce_seconds(collective_link(setup), profile.parameter_bytes, setup.processes, messages=buckets)
    if setup.hardware.shared_compute:
        return whole  # one pool of cores: communication and computation take turns
    last_bucket = whole / buckets
    hidden_window = backward_seconds * (buckets - 1) / buckets
    return max(last_bucket, whole - hidden_window)


def exposed_zero_seconds(setup: Setup, backward_seconds: float) -> dict[str, float]:
    """ZeRO-1/2 (whole weights, sharded optimizer state, gradients whole or sharded): the gradients reduce-scattered
    in float32 bucket by bucket while backward runs (half an all-reduce, hidden like DDP's but for the last bucket),
    each process steps its shard, and the updated weights are all-gathered after the step (exposed: the next
    forward needs them). Together the bytes of one all-reduce (Rajbhandari et al. 2020, section 7.2)."""
    profile, constants = setup.profile, setup.constants
    link, group = shard_group_link(setup), setup.shard_size
    buckets = max(1, -(-profile.parameter_bytes // constants.bucket_bytes))
    scatter = ring_all_gather_seconds(link, profile.parameters * REDUCE_SCATTER_BYTES_PER_PARAMETER, group, buckets)
    gather = ring_all_gather_seconds(link, profile.parameter_bytes, group, buckets)
    if setup.hardware.shared_compute:
        return {"reduce_scatter": scatter, "all_gather": gather}
    hidden_window = backward_seconds * (buckets - 1) / buckets
    return {"reduce_scatter": max(scatter / buckets, scatter - hidden_window), "all_gather": gather}


def exposed_sharded_seconds(setup: Setup, forward_seconds: float, backward_seconds: float) -> tuple[float, float]:
    """(exposed all-gather, exposed reduce-scatter) of a strategy that shards the weights (FSDP / ZeRO-3).

    Forward gathers every unit's parameters (16-bit under mixed precision); backward gathers them again where
    forward dropped them (Traits.gathers PER_UNIT; FOR_THE_STEP keeps them) and reduce-scatters the gradients in
    float32: with both gathers, in fp32, 1.5 times the bytes of DDP's all-reduce (Rajbhandari et al. 2020, section
    7.2). Each unit's collective is prefetched while the previous unit computes, so, as for DDP's buckets, all but
    the first unit's are hidden when the compute is long enough: at least the largest unit's share is exposed (the
    root's, with a tied embedding, is the first gathered in forward and the last reduce-scattered in backward). On
    virtual CPU devices nothing overlaps."""
    group = setup.shard_size
    if group <= 1:
        return 0.0, 0.0
    profile = setup.profile
    link = shard_group_link(setup)
    units = profile.units
    gather = ring_all_gather_seconds(
        link, profile.parameters * gathered_bytes_per_parameter(setup.precision), group, messages=units
    )
    scatter = ring_all_gather_seconds(
        link, profile.parameters * REDUCE_SCATTER_BYTES_PER_PARAMETER, group, messages=units
    )
    again = gather if setup.traits.gathers == PER_UNIT else 0.0  # backward's gathers of what forward dropped
    if setup.hardware.shared_compute:
        return gather + again, scatter
    largest_share = profile.unit_parameters / profile.parameters
    hidden = 1 - largest_share  # the compute the other units' collectives can hide behind
    forward = max(gather * largest_share, gather - forward_seconds * hidden)
    backward_comm = again + scatter
    backward = max(backward_comm * largest_share, backward_comm - backward_seconds * hidden)
    return forward + backward * again / backward_comm, backward * scatter / backward_comm


# ---- memory -------------------------------------------------------------------------------------

# what memory_by_category counts, named as dpkit profile books it (dpkit.observe.memory.CATEGORIES) where it can be
MEMORY_CATEGORIES = (
    "parameters",  # the weights this process keeps between steps (whole, or its shards)
    "gradients",  # the gradients it holds after the exchange (whole, or its shards)
    "optimizer_state",  # its optimizer state (whole, or its shards)
    "gathered_parameters",  # sharded weights gathered whole to compute, and a unit's whole gradient before its
    # reduce-scatter
    "gradient_buckets",  # DDP's buckets: a second copy of whole gradients, for the all-reduce
    "autocast_copies",  # mixed precision: autocast's 16-bit copy of each whole weight, kept for backward
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
    parameters = profile.parameters
    whole = {part: per * parameters for part, per in state_bytes_per_parameter(setup.optimizer).items()}
    group = setup.shard_size
    part_of_traits = {
        "parameters": traits.weights,
        "gradients": traits.gradients,
        "optimizer_state": traits.optimizer_state,
    }
    kept = {
        part: (0.0 if setup.offload else whole[part] / group) if part_of_traits[part] == SHARDED else float(whole[part])
        for part in whole
    }
    mixed = mixed_precision(setup.precision)
    unit = profile.unit_parameters
    gathered = 0.0
    if traits.weights == SHARDED:
        # gathered in the param dtype (16-bit under mixed precision): the largest unit and the next one, prefetched;
        # or, kept from forward to backward, every unit: the whole model
        prefetched = PREFETCHED_UNITS if profile.units > 1 else 0
        held = (1 + prefetched) * unit if traits.gathers == PER_UNIT else parameters
        gathered += held * gathered_bytes_per_parameter(setup.precision)
    if traits.gradients == SHARDED:
        gathered += unit * REDUCE_SCATTER_BYTES_PER_PARAMETER  # a unit's whole gradient before its reduce-scatter
    # autocast's 16-bit copies of the whole weights, held from forward until backward used them (gathered units are
    # 16-bit already)
    autocast = AUTOCAST_COPY_BYTES_PER_PARAMETER * parameters if mixed and traits.weights == WHOLE else 0
    # DDP's gradient buckets are a second copy of the whole gradients in every process
    buckets = (
        whole["gradients"]
        if traits.processes == PER_DEVICE and traits.gradients == WHOLE and setup.processes > 1
        else 0
    )
    activation_scale = 0.5 if mixed else 1.0
    per_sample = profile.activation_bytes_per_sample * activation_scale + 2 * profile.output_bytes_per_sample
    batch = setup.batch_per_device
    first = {
        "parameters": kept["parameters"],
        "gradients": kept["gradients"],
        "optimizer_state": kept["optimizer_state"],
        "gathered_parameters": gathered,
        "gradient_buckets": buckets,
        "autocast_copies": autocast,
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


def lightest_sharding(traits: Traits, processes: int, per_node: int) -> tuple[int, int]:
    """A sort key, lightest first: how many parts of the state a strategy shards, then over how many processes
    (its shard group on `processes` in all, `per_node` on each node). `auto` and the advisor take the lightest
    sharding that fits: less sharded, less to gather and to save collectively, and more replicas to read from."""
    return len(traits.sharded_parts), traits.shard_size(processes, per_node)


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
    global_batch: int | None = None,
    options: Mapping[str, Any] | None = None,
) -> Prediction:
    """One configuration (see Setup; `options`: the strategy's). `global_batch`: the samples of the step in all,
    split across the devices, the fullest taking `batch_per_device` (their largest share), which sets the step time
    and the peak memory."""
    setup = Setup(
        profile, hardware, strategy, devices, batch_per_device, precision, constants, optimizer, dict(options or {})
    )
    return predict_setup(setup, global_batch)


def predict_setup(setup: Setup, global_batch: int | None = None) -> Prediction:
    """The prediction for one Setup (see predict)."""
    hardware, devices = setup.hardware, setup.devices
    if devices < 1:
        raise ValueError(f"devices: expected positive device counts, got {devices}")
    if setup.batch_per_device < 1:
        raise ValueError(f"batch_per_device: expected at least 1, got {setup.batch_per_device}")
    if global_batch is not None and global_batch < setup.processes:
        raise ValueError(
            f"batch_size: {global_batch} samples leave some of the {setup.processes} devices without one; "
            f"expected at least one sample per device"
        )
    if setup.optimizer not in OPTIMIZER_STATE_BYTES_PER_PARAMETER:
        raise ValueError(
            f"optimizer: expected one of {', '.join(OPTIMIZER_STATE_BYTES_PER_PARAMETER)}, got {setup.optimizer!r}"
        )
    breakdown = step_breakdown(setup)
    step = sum(breakdown.values())
    peaks, _ = memory_per_device(setup)
    largest = largest_batch_per_device(setup)
    samples = setup.batch_per_device * setup.processes if global_batch is None else global_batch
    prediction = Prediction(
        setup.strategy,
        devices,
        hardware.nodes,
        setup.batch_per_device,
        step,
        breakdown,
        peaks,
        largest,
        samples_per_second=samples / step,
        global_batch=global_batch,
        options=dict(setup.options),
    )
    usable = hardware.gpu.memory_bytes * setup.constants.memory_headroom
    if not hardware.shared_compute and max(peaks) > usable:
        prediction.fits = False
        prediction.notes.append(
            f"does not fit: {max(peaks) / 2**30:.1f} GiB on the fullest device, "
            f"{usable / 2**30:.1f} GiB usable of {hardware.gpu.memory_bytes / 2**30:.0f} GiB on a {hardware.gpu.name}"
        )
    if not runs_at(setup.strategy, setup.precision, setup.options):
        prediction.runs = False
        prediction.notes.append("cannot run: no GradScaler for precision 16-mixed (bf16-mixed runs)")
    if hardware.link.max_devices is not None and devices > hardware.link.max_devices:
        prediction.notes.append(f"{hardware.link.name} joins at most {hardware.link.max_devices} devices")
    return prediction


def predict_all(
    profile: ModelProfile,
    hardware: Hardware,
    strategies: list[str],
    device_counts: list[int],
    batch_per_device: int | BatchSize,
    precision: str = "32",
    constants: CostConstants = CostConstants(),
    optimizer: str = "adam",
) -> list[Prediction]:
    """Every strategy at every device count it can use (only strategies with a process per device, such
    as ddp, span nodes), with speed-up and efficiency against the reference strategy on one device of one node
    (with a global batch: that device running the whole batch). A plain number is a batch per device."""
    batch = as_batch(batch_per_device)

    def predict_batch(machine: Hardware, strategy: str, devices: int) -> Prediction:
        total = devices * machine.nodes
        return predict(
            profile,
            machine,
            strategy,
            devices,
            batch.share(total),
            precision,
            constants,
            optimizer,
            global_batch=None if batch.per_device else batch.samples,
        )

    baseline = predict_batch(replace(hardware, nodes=1), reference(), 1)
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
            prediction = predict_batch(node_hardware, strategy, devices)
            prediction.speedup = prediction.samples_per_second / baseline.samples_per_second
            prediction.efficiency = prediction.speedup / prediction.total_devices
            predictions.append(prediction)
    return predictions
