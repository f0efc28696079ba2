"""Where data parallelism starts to pay: the smallest batch at which a strategy on N devices outruns one device.

A step on N devices pays fixed costs one device does not (DataParallel's scatter, per-step replicas, gather and
GIL-serialised launches; a process group's all-reduce) and divides only the per-sample work. So its throughput
against one device's grows with the batch and crosses 1 at the break-even batch, when it crosses at all:

    break_even_batch(profile, hardware, "dp", 2)                  # samples per device, or None
    speedup_curve(profile, hardware, "dp", 2, [8, 16, 32, 64])    # [(batch, speed-up), ...]

Batches are per device (weak scaling: one device runs one device's share, N devices N shares), the comparison
the published speed-ups make; `per_device=False` compares the same global batch on one device and on N.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpkit.plan.configuration import BatchSize, Hardware
from dpkit.plan.constants import CostConstants
from dpkit.plan.cost_model import predict
from dpkit.plan.profiles import ModelProfile
from dpkit.strategies import reference

MOST_SAMPLES = 1 << 20  # the largest batch the search looks at


def speedup(
    profile: ModelProfile,
    hardware: Hardware,
    strategy: str,
    devices: int,
    batch: int,
    precision: str = "32",
    constants: CostConstants = CostConstants(),
    optimizer: str = "adam",
    per_device: bool = True,
) -> float:
    """Throughput of `strategy` on `devices` devices over the reference on one, at `batch` samples (per device,
    or in all)."""
    size = BatchSize(batch, per_device)
    many = predict(
        profile,
        hardware,
        strategy,
        devices,
        size.share(devices),
        precision,
        constants,
        optimizer,
        global_batch=None if per_device else batch,
    )
    one = predict(profile, hardware, reference(), 1, size.share(1), precision, constants, optimizer)
    return many.samples_per_second / one.samples_per_second


def speedup_curve(
    profile: ModelProfile,
    hardware: Hardware,
    strategy: str,
    devices: int,
    batches: Sequence[int],
    precision: str = "32",
    constants: CostConstants = CostConstants(),
    optimizer: str = "adam",
    per_device: bool = True,
) -> list[tuple[int, float]]:
    return [
        (batch, speedup(profile, hardware, strategy, devices, batch, precision, constants, optimizer, per_device))
        for batch in batches
        if per_device or batch >= devices
    ]


def break_even_batch(
    profile: ModelProfile,
    hardware: Hardware,
    strategy: str,
    devices: int,
    precision: str = "32",
    constants: CostConstants = CostConstants(),
    optimizer: str = "adam",
    per_device: bool = True,
    most: int = MOST_SAMPLES,
) -> int | None:
    """The smallest batch (per device, or in all) at which `strategy` on `devices` devices is at least as fast
    as one device, by doubling and then bisection (the speed-up grows with the batch); None when it does not get
    there by `most` samples, or when the strategy cannot use that many devices."""
    if devices < 2:
        raise ValueError(f"devices: break-even compares several devices with one; expected at least 2, got {devices}")

    def pays(batch: int) -> bool:
        return speedup(profile, hardware, strategy, devices, batch, precision, constants, optimizer, per_device) >= 1

    low = 1 if per_device else devices
    if pays(low):
        return low
    high = low * 2
    while high <= most and not pays(high):
        low, high = high, high * 2
    if high > most:
        return None
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if pays(middle) else (middle, high)
    return high
