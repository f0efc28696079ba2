"""One step's time, phase by phase: each term is what one of the strategy's traits (or the hardware) adds, and
step_breakdown adds them up. No term asks which strategy it is.

    computing       forward, backward: FLOPs at the achieved rate and the memory passes FLOP counts leave out
    launching       the host's kernel launches the computing does not hide: several replicas in one process take
                    turns on the GIL (Traits.processes, replicas); sharded weights add each unit's collectives'
                    kernels and hooks (Traits.weights)
    scatter         one process loads the batch and sends each replica its rows (several replicas in one process)
    replicas        copied from device 0 at every step (Traits.replicas PER_STEP): the broadcast, the objects
                    made again, and the reduce back into device 0
    loss            where Traits.loss runs it: device 0 over every replica's gathered outputs, or each replica
    exchange        how persistent replicas sum their gradients: collectives as the traits shard the state
                    (communication.py), or one sum in memory (Traits.shares_host_weights, virtual CPU devices);
                    compressed (Setup.compression), fewer bytes and the compression's own work (compression_cost.py)
    optimizer       its memory passes over what this process steps (1/S where Traits.optimizer_state is SHARDED)
    overhead        the step's Python, and the hand-offs to one process's replica threads
    accumulation    K micro-batches per optimizer step (Setup.accumulate): everything K times but the gradient
                    exchange, the gathers of weights kept for the step and the optimizer, once per step
"""

from __future__ import annotations

from dataclasses import dataclass

from dpkit.plan.communication import exposed_collective_seconds
from dpkit.plan.compression_cost import compression_seconds, wire_fraction
from dpkit.plan.configuration import Setup, achieved_flops, kernel_launch_seconds, mixed_precision
from dpkit.plan.constants import OPTIMIZER_TRAFFIC_BYTES_PER_PARAMETER, SHARDED_KERNELS_PER_COLLECTIVE
from dpkit.plan.profiles import FP32_BYTES
from dpkit.plan.transfers import root_fan_seconds, transfer_seconds
from dpkit.strategies import IN_REPLICAS, ON_ROOT, ONE_PROCESS, PER_STEP, PER_UNIT, PERSISTENT, SHARDED

PHASE_ORDER = (
    "scatter",
    "replicate",
    "forward",
    "launch",
    "gather",
    "loss",
    "backward",
    "reduce",
    "compress",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "optimizer",
    "overhead",
)


def step_breakdown(setup: Setup) -> dict[str, float]:
    """Seconds per phase of one step on the slowest device (device 0 under dp), as they add up: the terms the
    strategy's traits contribute (this module's docstring), each phase the sum of what the terms put in it."""
    work = DeviceWork.of(setup)
    forward, forward_host = forward_seconds(setup, work)
    backward, backward_host = backward_seconds(setup, work)
    phases = {"forward": forward, "backward": backward, "launch": forward_host + backward_host}
    phases.update(scatter_seconds(setup))
    phases.update(per_step_replica_seconds(setup, work))
    phases.update(loss_seconds(setup, work))
    phases.update(gradient_exchange_seconds(setup, work, forward, backward))
    phases["optimizer"] = optimizer_seconds(setup, work)
    phases["overhead"] = overhead_seconds(setup, work)
    phases = accumulated(setup, phases)
    return {name: phases[name] for name in PHASE_ORDER if name in phases and phases[name] > 0}


# what happens once per optimizer step, whatever the micro-batches: the gradient exchange (and its compression),
# and the optimizer's step
ONCE_PER_STEP = ("compress", "all_reduce", "reduce_scatter", "optimizer")


def accumulated(setup: Setup, phases: dict[str, float]) -> dict[str, float]:
    """One optimizer step of Setup.accumulate micro-batches: each micro-batch computes, launches, scatters, makes
    its replicas and gathers again; the gradients are exchanged once, in the last micro-batch's backward (what it
    cannot hide is the same as without accumulation), and the optimizer steps once. Weights gathered for the step
    (Traits.gathers FOR_THE_STEP) or all-gathered after it (ZeRO-1) are gathered once; those dropped after each
    pass (PER_UNIT) are gathered again in each micro-batch."""
    if setup.accumulate <= 1:
        return phases
    once = set(ONCE_PER_STEP) | ({"all_gather"} if setup.traits.gathers != PER_UNIT else set())
    return {name: seconds * (1 if name in once else setup.accumulate) for name, seconds in phases.items()}


@dataclass(frozen=True)
class DeviceWork:
    """What the terms share: one device's computing and launching in a step, and how the step runs them."""

    crowding: float  # virtual CPU devices divide one pool of cores: beyond compute_slots devices, each runs slower
    memory_rate: float  # one device's memory bandwidth, crowded
    forward_compute: float  # seconds of forward's arithmetic and memory passes
    forward_launch: float  # host seconds of launching forward's kernels (and the sharded units' hooks)
    backward_launch: float
    launch_seconds: float  # one kernel launch
    threaded: bool  # several replicas driven by one process's threads, taking turns on the GIL
    # virtual CPU devices, replicas re-made every step: autograd runs their backward in the one calling thread
    serial_backward: bool
    shared_weights: bool  # virtual CPU devices, replicas that are views of one copy of the weights

    @classmethod
    def of(cls, setup: Setup) -> DeviceWork:
        hardware, traits = setup.hardware, setup.traits
        shared = hardware.shared_compute
        crowding = max(1.0, setup.processes / hardware.compute_slots) if shared else 1.0
        rate_per_device = achieved_flops(hardware, setup.precision, setup.constants) / crowding
        memory_rate = hardware.gpu.memory_bytes_per_second / crowding
        profile = setup.profile
        forward_compute = setup.batch_per_device * (
            profile.flops_per_sample / rate_per_device + memory_pass_bytes_per_sample(setup) / memory_rate
        )
        forward_launch, backward_launch = launch_work_seconds(setup)
        return cls(
            crowding,
            memory_rate,
            forward_compute,
            forward_launch,
            backward_launch,
            kernel_launch_seconds(hardware, setup.constants),
            threaded=traits.threads_per_step and setup.devices > 1,
            serial_backward=shared and traits.threads_per_step and traits.replicas == PER_STEP,
            shared_weights=traits.shares_host_weights and shared,
        )


def memory_pass_bytes_per_sample(setup: Setup) -> float:
    """The memory passes of the operations FLOP counts leave out (the elementwise ones: activations,
    normalizations, the loss's softmax): about a write of what forward saves for backward and of the outputs,
    read and written again in backward."""
    activation_scale = 0.5 if mixed_precision(setup.precision) else 1.0
    return setup.profile.activation_bytes_per_sample * activation_scale + setup.profile.output_bytes_per_sample


def launch_work_seconds(setup: Setup) -> tuple[float, float]:
    """Host seconds of launching one replica's forward and backward (twice forward's kernels). Sharded weights
    (Traits.weights SHARDED, over more than one process) add each unit's hooks and its collectives' kernels: a
    gather per unit in forward, in backward a reduce-scatter per unit and a gather where forward dropped it."""
    profile, constants = setup.profile, setup.constants
    units = profile.units if setup.traits.weights == SHARDED and setup.shard_size > 1 else 0
    kernels = profile.kernels_per_forward + SHARDED_KERNELS_PER_COLLECTIVE * units
    launch_seconds = kernel_launch_seconds(setup.hardware, constants)
    forward = kernels * launch_seconds
    forward += units * constants.unit_seconds
    backward = 2 * kernels * launch_seconds
    backward += units * constants.unit_seconds
    return forward, backward


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


def host_launch_seconds(setup: Setup, work: DeviceWork, launch: float, compute: float) -> float:
    """What a pass's launching adds to its computing: several replicas in one process take turns on the GIL;
    a device driven alone queues its kernels ahead of it on a GPU, so only launching slower than computing
    shows; on virtual CPU devices nothing runs ahead of the host, and launching and computing add up."""
    hardware = setup.hardware
    if work.threaded:
        return threaded_launch_seconds(
            launch, compute, setup.devices, work.crowding, hardware.shared_compute, setup.constants.gil_share
        )
    if hardware.shared_compute:
        return launch * work.crowding  # a process per device: each launches its own, on shared cores
    return max(0.0, launch - compute)


def forward_seconds(setup: Setup, work: DeviceWork) -> tuple[float, float]:
    """(forward's computing, the host time its launching adds)."""
    return work.forward_compute, host_launch_seconds(setup, work, work.forward_launch, work.forward_compute)


def backward_seconds(setup: Setup, work: DeviceWork) -> tuple[float, float]:
    """(backward, the host time its launching adds): twice forward's computing (Kaplan et al. 2020). On a GPU
    autograd's device threads launch without the GIL, ahead of the device. On virtual CPU devices autograd runs
    the backward of replicas re-made every step in the one calling thread, one replica after the other, uncrowded
    (launches and computing); persistent replicas run theirs in their own threads, as in forward."""
    backward_compute = 2 * work.forward_compute
    hardware = setup.hardware
    if not hardware.shared_compute:
        return max(backward_compute, work.backward_launch), 0.0
    if work.serial_backward:
        profile, local = setup.profile, setup.devices
        rate = achieved_flops(hardware, setup.precision, setup.constants)
        memory_alone = hardware.gpu.memory_bytes_per_second
        per_sample = profile.flops_per_sample / rate + memory_pass_bytes_per_sample(setup) / memory_alone
        return local * 2 * setup.batch_per_device * per_sample, local * work.backward_launch
    return backward_compute, host_launch_seconds(setup, work, work.backward_launch, backward_compute)


def scatter_seconds(setup: Setup) -> dict[str, float]:
    """Several replicas in one process: it loads the whole batch and sends every replica its rows."""
    if not setup.traits.threads_per_step:
        return {}
    batch_bytes = setup.batch_per_device * setup.profile.input_bytes_per_sample
    return {"scatter": root_fan_seconds(setup.hardware.link, batch_bytes, setup.processes - 1)}


def per_step_replica_seconds(setup: Setup, work: DeviceWork) -> dict[str, float]:
    """Replicas re-made at every step (Traits.replicas PER_STEP, DataParallel): the parameters copied from device 0
    to every replica, every replica's modules and parameter tensors made again in Python (the first replica's
    too: on one device dpkit's DataParallel still makes its one replica), and in backward every replica's
    gradients summed into device 0's."""
    if setup.traits.replicas != PER_STEP:
        return {}
    profile, constants, link = setup.profile, setup.constants, setup.hardware.link
    total, others = setup.processes, setup.processes - 1
    params_bytes = profile.parameter_bytes
    remake = (
        profile.module_count * constants.module_seconds + max(1, profile.parameter_tensors) * constants.tensor_seconds
    )
    return {
        "replicate": root_fan_seconds(link, params_bytes, others) + total * remake,
        "reduce": root_fan_seconds(link, params_bytes, others) + others * 3 * params_bytes / work.memory_rate,
    }


def loss_seconds(setup: Setup, work: DeviceWork) -> dict[str, float]:
    """The loss and its gradient (read the outputs, write the gradient, read it back) where Traits.loss runs it,
    and what replicas re-made every step gather on device 0 for it: the loss ON_ROOT, every replica's outputs, and
    device 0 alone computes it over them; IN_REPLICAS, each replica's on its rows in its own thread (crowded like
    the computing; serially with the backward where that is serial) and device 0 gathers only the losses."""
    traits, link = setup.traits, setup.hardware.link
    total, others = setup.processes, setup.processes - 1
    output_bytes = setup.batch_per_device * setup.profile.output_bytes_per_sample
    gathers = traits.replicas == PER_STEP
    if gathers and traits.loss == ON_ROOT:
        if setup.hardware.shared_compute:
            # one memory: the gather writes every replica's rows, device 0's included, into a new tensor (on one
            # device too), at the in-process copy rate
            gather = transfer_seconds(link, total * output_bytes, others)
        else:
            gather = root_fan_seconds(link, output_bytes, others)
        return {"gather": gather, "loss": 3 * total * output_bytes / work.memory_rate}
    phases = {"loss": 3 * output_bytes / work.memory_rate * (setup.devices if work.serial_backward else 1)}
    if gathers and traits.loss == IN_REPLICAS:
        phases["gather"] = root_fan_seconds(link, FP32_BYTES, others)
    return phases


def gradient_exchange_seconds(
    setup: Setup, work: DeviceWork, forward_seconds: float, backward_seconds: float
) -> dict[str, float]:
    """How several replicas that outlive the step get the summed gradient: replicas that share host weights on
    virtual CPU devices (Traits.shares_host_weights) sum into replica 0's weights in memory; persistent ones
    (Traits.replicas PERSISTENT) exchange it by collectives, as the traits shard the state, with what the
    computing cannot hide exposed (communication.py). Replicas re-made every step reduce into device 0 instead
    (per_step_replica_seconds). A compression adds its own work on each device (compression_cost.py)."""
    if setup.processes <= 1:
        return {}
    phases: dict[str, float] = {}
    if work.shared_weights:
        summed_bytes = setup.profile.parameter_bytes * wire_fraction(setup)
        phases["all_reduce"] = (setup.processes - 1) * 3 * summed_bytes / work.memory_rate
    elif setup.traits.replicas == PERSISTENT:
        phases.update(exposed_collective_seconds(setup, forward_seconds, backward_seconds))
    else:
        return phases
    if setup.compression.compresses:
        flops_rate = achieved_flops(setup.hardware, "32", setup.constants) / work.crowding  # float32 gradients
        phases["compress"] = compression_seconds(setup, work.memory_rate, flops_rate, work.launch_seconds)
    return phases


def optimizer_seconds(setup: Setup, work: DeviceWork) -> float:
    """The optimizer step: its memory passes over the parameters (each process steps only its shard where
    Traits.optimizer_state is SHARDED), once per copy this process steps, and its for-each kernels' launches."""
    profile = setup.profile
    traffic: float = OPTIMIZER_TRAFFIC_BYTES_PER_PARAMETER[setup.optimizer] * profile.parameters
    if setup.traits.optimizer_state == SHARDED:
        traffic /= setup.shard_size
    copies = copies_stepped(setup, work)
    launches = copies * max(1, profile.parameter_tensors) * work.launch_seconds / 4  # foreach kernels
    return optimizer_memory_seconds(setup, work, traffic, copies) + launches


def copies_stepped(setup: Setup, work: DeviceWork) -> int:
    """The copies of the model one process steps: each of its persistent replicas' own (one process driving them,
    unless they share host weights); a process per device, or replicas re-made every step, one."""
    traits = setup.traits
    one_process = traits.processes == ONE_PROCESS
    return setup.devices if one_process and traits.replicas == PERSISTENT and not work.shared_weights else 1


def optimizer_memory_seconds(setup: Setup, work: DeviceWork, traffic: float, copies: int) -> float:
    """The optimizer's memory passes: on GPUs each device steps on its own memory; on virtual CPU devices shared
    weights are stepped once, split among the replicas' threads; persistent replicas step their copies at once,
    crowded; otherwise one thread steps while the replicas' threads wait, and nothing crowds it."""
    hardware = setup.hardware
    if not hardware.shared_compute:
        return traffic / work.memory_rate
    if work.shared_weights:
        return traffic / (hardware.gpu.memory_bytes_per_second * min(setup.devices, hardware.compute_slots))
    if setup.traits.replicas == PERSISTENT:
        return traffic / work.memory_rate * copies
    return traffic / hardware.gpu.memory_bytes_per_second


def overhead_seconds(setup: Setup, work: DeviceWork) -> float:
    """The Python of a step, and one process's replica threads handed their jobs together and waited for together:
    about three hand-offs a step (forward, backward, step or gather), each costing one thread's wake-up and join,
    not one per replica."""
    constants = setup.constants
    return constants.step_overhead_seconds + (constants.thread_seconds * 3 if work.threaded else 0.0)
