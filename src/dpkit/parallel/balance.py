"""Chunk sizes from measured numbers: equal predicted peak memory, or equal predicted time, per device.

A pure solver: it never runs or measures a step. The calibration that measures steps and feeds it lives
above parallel/ (dpkit.observe.measured_balance).

Model: on device i, one step with r rows costs `fixed_i + per_row_i * r` (bytes at the peak, or
seconds). Device 0 has the larger `fixed` (it alone holds the reduced gradients and the optimizer
state), so equalising the prediction gives it fewer rows. `fill_rows` solves
    minimise max_i fixed_i + per_row_i * r_i   subject to   sum r_i = batch, 0 <= r_i <= max_rows_i
exactly (water-filling to a level, then the last few rows one at a time where they cost least).

Memory needs two measured steps to separate `fixed` from `per_row` on every device: the first at the
even split, the second with device 0's share halved; both come after one unmeasured warm-up step, in
which optimizers create their state. Speed measures one step after the warm-up (time through the
origin). The model does not depend on the batch size, so a new batch size is re-solved without
measuring again. Calibration steps run at the even (or perturbed) split, before any limit is known.

Where a device's fixed share is itself the largest peak (a small batch: each other device's rows cost less than
what device 0 holds whatever its rows), no split lowers it; `fixed_share_limit` says so, and from which batch
the other devices reach it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dpkit.parallel.scatter import split_sizes

BALANCE_MODES = ("memory", "speed")

# Measured steps per mode, and the forward calls calibration takes before the balanced split is used:
# the measured steps plus one warm-up step (optimizers create their state in their first step).
MEASURED_STEPS = {"memory": 2, "speed": 1}
CALIBRATION_CALLS = {mode: steps + 1 for mode, steps in MEASURED_STEPS.items()}

# Memory balance accepts peaks up to this fraction above the best achievable one in exchange for a more
# even split: when device 0's own state already outweighs every other device's whole share, the strict
# optimum leaves device 0 idle, which costs a device's worth of throughput to save no memory that matters.
MEMORY_SLACK = 0.03

log = logging.getLogger("dpkit")


@dataclass(frozen=True)
class LinearCost:
    """Per device: cost = fixed + per_row * rows."""

    fixed: tuple[float, ...]
    per_row: tuple[float, ...]

    def predict(self, sizes: Sequence[int]) -> list[float]:
        return [f + a * r for f, a, r in zip(self.fixed, self.per_row, sizes)]


def fit_linear(points: Sequence[Sequence[tuple[int, float]]]) -> LinearCost:
    """Least-squares line per device through its (rows, cost) points.

    A device whose points all have the same row count gets the median slope of the others (or cost per
    row when no device can be fitted), so one unchanged device does not stop the balance.
    """
    slopes: list[float | None] = []
    for device_points in points:
        rows = [r for r, _ in device_points]
        if len(set(rows)) < 2:
            slopes.append(None)
            continue
        mean_r = sum(rows) / len(rows)
        mean_c = sum(c for _, c in device_points) / len(device_points)
        var = sum((r - mean_r) ** 2 for r in rows)
        slopes.append(sum((r - mean_r) * (c - mean_c) for r, c in device_points) / var)
    known = sorted(s for s in slopes if s is not None)
    fallback = known[len(known) // 2] if known else None
    fixed, per_row = [], []
    for device_points, slope in zip(points, slopes):
        if slope is None:
            slope = fallback
        if slope is None:  # nothing to fit: cost proportional to rows
            most_rows, cost = max(device_points)
            slope = cost / most_rows if most_rows else 0.0
        slope = max(slope, 0.0)
        intercept = sum(c - slope * r for r, c in device_points) / len(device_points)
        fixed.append(max(intercept, 0.0))
        per_row.append(slope)
    return LinearCost(tuple(fixed), tuple(per_row))


def fill_rows(batch_size: int, cost: LinearCost, max_rows: Sequence[int] | None = None) -> list[int]:
    """Rows per device minimising the largest predicted cost, never above a device's `max_rows`."""
    n = len(cost.fixed)
    caps = [batch_size] * n if max_rows is None else [min(batch_size, max(0, int(m))) for m in max_rows]
    if sum(caps) < batch_size:
        raise ValueError(
            f"max_bytes_per_device: the devices can hold at most {sum(caps)} rows together ({caps} each) but the "
            f"batch has {batch_size}; use a smaller batch or raise max_bytes_per_device"
        )
    # a device with no measured per-row cost is treated as nearly free, not as infinitely fast
    positive = [a for a in cost.per_row if a > 0]
    floor_rate = (min(positive) if positive else 1.0) * 1e-6
    rate = [a if a > 0 else floor_rate for a in cost.per_row]

    def rows_at(level: float) -> list[int]:
        return [min(cap, max(0, math.floor((level - f) / a))) for f, a, cap in zip(cost.fixed, rate, caps)]

    low = min(cost.fixed)
    high = max(f + a * batch_size for f, a in zip(cost.fixed, rate))
    for _ in range(100):
        mid = (low + high) / 2
        if sum(rows_at(mid)) <= batch_size:
            low = mid
        else:
            high = mid
    rows = rows_at(low)
    for _ in range(batch_size - sum(rows)):  # at most n rows left: each where it raises the peak least
        best = min(
            (i for i in range(n) if rows[i] < caps[i]), key=lambda i: (cost.fixed[i] + rate[i] * (rows[i] + 1), -i)
        )
        rows[best] += 1
    return rows


def spread_within_slack(
    rows: Sequence[int], cost: LinearCost, caps: Sequence[int], slack: float = MEMORY_SLACK
) -> list[int]:
    """The most even split whose predicted peaks stay within `slack` of the largest peak of `rows`."""
    ceiling = max(cost.predict(rows)) * (1.0 + slack)
    room = [
        cap if a <= 0 else min(cap, max(r, math.floor((ceiling - f) / a)))
        for r, f, a, cap in zip(rows, cost.fixed, cost.per_row, caps)
    ]
    batch_size, n = sum(rows), len(rows)
    spread, remaining = [0] * n, batch_size
    for k, i in enumerate(sorted(range(n), key=lambda i: (room[i], i))):  # fill the tightest devices first
        spread[i] = min(room[i], -(-remaining // (n - k)))
        remaining -= spread[i]
    return spread if remaining == 0 else list(rows)


@dataclass(frozen=True)
class FixedShareLimit:
    """A split whose largest predicted peak is one device's fixed share, which no split of the batch lowers."""

    device: int  # the device whose fixed share is the largest peak
    fixed: float  # that share (bytes): what it holds whatever its rows
    batch_to_reach: int  # the global batch at which every other device reaches it, this one keeping its rows


def fixed_share_limit(rows: Sequence[int], cost: LinearCost, slack: float = MEMORY_SLACK) -> FixedShareLimit | None:
    """Where the largest predicted peak of `rows` is, within `slack`, the largest fixed share: moving rows cannot
    lower it, and the peaks even out only from a batch at which the other devices' rows cost as much. None where
    rows set the largest peak, or where some other device never reaches that share (no per-row cost)."""
    top = max(range(len(rows)), key=lambda i: (cost.fixed[i], -i))
    fixed = cost.fixed[top]
    if fixed <= 0 or max(cost.predict(rows)) > fixed * (1.0 + slack):
        return None
    batch = rows[top]
    for i, (f, a) in enumerate(zip(cost.fixed, cost.per_row)):
        if i == top or f >= fixed:
            continue
        if a <= 0:
            return None
        batch += math.ceil((fixed - f) / a)
    return FixedShareLimit(top, fixed, batch) if batch > sum(rows) else None


def max_rows_within(limits_bytes: Sequence[float | None], cost: LinearCost, batch_size: int) -> list[int]:
    """Rows each device can take before its predicted peak passes its limit (None = no limit)."""
    caps = []
    for limit, fixed, per_row in zip(limits_bytes, cost.fixed, cost.per_row):
        if limit is None:
            caps.append(batch_size)
        elif fixed > limit:
            caps.append(0)
        elif per_row <= 0:
            caps.append(batch_size)
        else:
            caps.append(min(batch_size, math.floor((limit - fixed) / per_row)))
    return caps


def calibration_split(batch_size: int, n_devices: int, measured_steps: int) -> list[int]:
    """The split of a calibration step: even, except the second memory measurement, which halves device 0's
    share so that every device's row count changes (two points per device fix its line)."""
    even = split_sizes(batch_size, n_devices)
    if measured_steps == 0 or n_devices == 1:
        return even
    moved = even[0] - even[0] // 2
    return [even[0] // 2] + [size + extra for size, extra in zip(even[1:], split_sizes(moved, n_devices - 1))]


def fit_cost(mode: str, points: Sequence[Sequence[tuple[int, float]]]) -> LinearCost:
    """The cost model from measured (rows, value) points per device: a line per device for memory (peak
    bytes), time through the origin for speed (seconds per row)."""
    if mode == "memory":
        return fit_linear(points)
    rates = [sum(c for _, c in p) / max(1, sum(r for r, _ in p)) if p else 0.0 for p in points]
    return LinearCost(tuple(0.0 for _ in rates), tuple(rates))


def solve(mode: str, batch_size: int, cost: LinearCost, limits_bytes: Sequence[float | None]) -> list[int]:
    """Rows per device for `batch_size`: memory equalises predicted peaks (within MEMORY_SLACK, under the
    limits), speed equalises predicted time."""
    if mode != "memory":
        return fill_rows(batch_size, cost)
    caps = max_rows_within(limits_bytes, cost, batch_size)
    return spread_within_slack(fill_rows(batch_size, cost, caps), cost, caps)
