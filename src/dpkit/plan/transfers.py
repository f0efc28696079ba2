"""Moving bytes over a link, the alpha-beta way: a message pays the link's latency, its bytes its bandwidth
(Hockney 1994; Thakur, Rabenseifner and Gropp 2005); through one root, and around a ring (Patarasuk and Yuan 2009).
docs/cost-model.md has the formulas."""

from __future__ import annotations

from dpkit.plan.catalogue import Link


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
