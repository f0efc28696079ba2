"""The collectives of replicas that persist, as the traits shard the state, and what of them the computing cannot
hide (Rajbhandari et al. 2020, section 7): nothing sharded, DDP's bucketed all-reduce of the gradients; the
optimizer state or the gradients sharded over whole weights (ZeRO-1/2), a reduce-scatter of the gradients and an
all-gather of the updated weights; the weights sharded (ZeRO-3, fsdp), their all-gathers unit by unit and the
gradients' reduce-scatter; across the replicas of a shard (hybrid sharding), the shards' all-reduce. Which link
each crosses: the node's, the one between processes, or the network across nodes. A compression (Setup.compression)
shrinks what the gradients' collectives carry (compression_cost.py); the parameters' all-gathers stay as they are.
"""

from __future__ import annotations

from dpkit.plan.catalogue import Link
from dpkit.plan.compression_cost import all_reduced_whole, collectives_per_bucket, wire_fraction
from dpkit.plan.configuration import Setup, gathered_bytes_per_parameter
from dpkit.plan.constants import REDUCE_SCATTER_BYTES_PER_PARAMETER
from dpkit.plan.transfers import ring_all_gather_seconds, ring_all_reduce_seconds
from dpkit.strategies import PER_DEVICE, PER_UNIT, SHARDED


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
        nbytes = profile.parameter_bytes * wire_fraction(setup) / (1 if shared_network else setup.shard_size)
        across = ring_all_reduce_seconds(link, nbytes, replicas, messages=profile.units)
        if hardware.shared_compute:
            phases["all_reduce"] = across
        else:
            share = profile.unit_parameters / profile.parameters
            phases["all_reduce"] = max(across * share, across - backward_seconds * (1 - share))
    return phases


def exposed_all_reduce_seconds(setup: Setup, backward_seconds: float) -> float:
    """DDP's bucketed ring all-reduce, started bucket by bucket while backward runs; what backward
    cannot hide is exposed: at least the last bucket, which is ready only when backward ends. Compressed, each
    bucket carries its share of the compressed bytes, in one all-reduce or PowerSGD's three."""
    profile = setup.profile
    buckets = setup.gradient_buckets
    whole = ring_all_reduce_seconds(
        collective_link(setup),
        profile.parameter_bytes * wire_fraction(setup),
        setup.processes,
        messages=buckets * collectives_per_bucket(setup.compression),
    )
    if setup.hardware.shared_compute:
        return whole  # one pool of cores: communication and computation take turns
    last_bucket = whole / buckets
    hidden_window = backward_seconds * (buckets - 1) / buckets
    return max(last_bucket, whole - hidden_window)


def exposed_zero_seconds(setup: Setup, backward_seconds: float) -> dict[str, float]:
    """ZeRO-1/2 (whole weights, sharded optimizer state, gradients whole or sharded): the gradients reduce-scattered
    in float32 bucket by bucket while backward runs (half an all-reduce, hidden like DDP's but for the last bucket),
    each process steps its shard, and the updated weights are all-gathered after the step (exposed: the next
    forward needs them). Together the bytes of one all-reduce (Rajbhandari et al. 2020, section 7.2). Under
    PowerSGD (stage 1 only: whole gradients) the gradients are all-reduced as ddp's, compressed."""
    profile = setup.profile
    link, group = shard_group_link(setup), setup.shard_size
    buckets = setup.gradient_buckets
    gradient_bytes = profile.parameters * REDUCE_SCATTER_BYTES_PER_PARAMETER * wire_fraction(setup)
    scatter = ring_all_gather_seconds(link, gradient_bytes, group, buckets)
    gather = ring_all_gather_seconds(link, profile.parameter_bytes, group, buckets)
    if all_reduced_whole(setup.compression):
        return {"all_reduce": exposed_all_reduce_seconds(setup, backward_seconds), "all_gather": gather}
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
        link, profile.parameters * REDUCE_SCATTER_BYTES_PER_PARAMETER * wire_fraction(setup), group, messages=units
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
