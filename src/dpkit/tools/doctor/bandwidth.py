"""Bandwidth as nccl-tests defines it (PERFORMANCE.md in NVIDIA/nccl-tests), and the message sizes measured."""

from __future__ import annotations


def algorithm_bandwidth(size_bytes: int, seconds: float) -> float:
    """nccl-tests' algbw: the bytes of one rank's buffer over the time the collective took."""
    if seconds <= 0:
        raise ValueError(f"seconds: expected a positive duration, got {seconds!r}")
    return size_bytes / seconds


def bus_bandwidth_factor(collective: str, world_size: int) -> float:
    """busbw / algbw for a collective over world_size ranks, as nccl-tests defines it.

    A ring all-reduce sends and receives 2(n-1)/n of the buffer per rank (reduce-scatter then
    all-gather); a pipelined broadcast moves the whole buffer once through every link.
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected at least 1, got {world_size}")
    factors = {
        "all_reduce": 2 * (world_size - 1) / world_size,
        "all_gather": (world_size - 1) / world_size,
        "reduce_scatter": (world_size - 1) / world_size,
        "broadcast": 1.0,
        "reduce": 1.0,
    }
    if collective not in factors:
        raise ValueError(f"collective: unknown collective {collective!r}; expected one of {', '.join(factors)}")
    return factors[collective]


def bus_bandwidth(collective: str, size_bytes: int, seconds: float, world_size: int) -> float:
    return algorithm_bandwidth(size_bytes, seconds) * bus_bandwidth_factor(collective, world_size)


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """min_bytes, min_bytes*factor, ... up to max_bytes (which is included even off the progression)."""
    if min_bytes < 4 or max_bytes < min_bytes:
        raise ValueError(f"message sizes: expected 4 <= min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    if factor < 2:
        raise ValueError(f"factor: expected an integer >= 2, got {factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    if sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes
