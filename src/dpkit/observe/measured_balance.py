"""The measured balance behind DataParallel(balance=...): measured steps in, the solver's chunk sizes out.

parallel/balance.py is a pure solver. This module decides which steps to measure (a warm-up, then the
even split, then for memory the split with device 0's share halved), measures them with an Observer from
one DataParallel call to the next (the whole step: forward, backward, optimizer), and hands the numbers
to the solver. It is plugged into the observation seam (dpkit.parallel.hooks) when this module is
imported, which `import dpkit` does, so dpkit.DataParallel(balance=...) measures with it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dpkit.observe.memory import device_key
from dpkit.observe.observer import Observer
from dpkit.observe.report import Report
from dpkit.parallel import hooks
from dpkit.parallel.balance import (
    BALANCE_MODES,
    MEASURED_STEPS,
    LinearCost,
    calibration_split,
    fit_cost,
    fixed_share_limit,
    solve,
    split_sizes,
)
from dpkit.parallel.data_parallel import DataParallel

log = logging.getLogger("dpkit")

# the phases whose time a device's rows cost (speed balance)
COMPUTE_PHASES = ("forward", "loss", "backward")


class Balancer:
    """The calibration sequence and the fitted cost: `plan(batch_size)` returns (sizes, measure); when
    `measure` is True the caller measures that step and passes one number per device to `record`."""

    def __init__(
        self, mode: str, device_keys: Sequence[str], max_bytes_per_device: Sequence[float | None] | None = None
    ):
        if mode not in BALANCE_MODES:
            raise ValueError(f"balance: expected one of {', '.join(map(repr, BALANCE_MODES))} or None, got {mode!r}")
        self.mode = mode
        self.device_keys = list(device_keys)
        self.limits = list(max_bytes_per_device) if max_bytes_per_device is not None else [None] * len(device_keys)
        self.points: list[list[tuple[int, float]]] = [[] for _ in device_keys]
        self.cost: LinearCost | None = None
        self._sizes: dict[int, list[int]] = {}
        self.measured_steps = 0
        self.calibration_calls = 0  # steps planned for measuring, the warm-up included
        self._warm_up_recorded = False

    @property
    def steps_to_measure(self) -> int:
        return MEASURED_STEPS[self.mode]

    def plan(self, batch_size: int, can_measure: bool = True) -> tuple[list[int], bool]:
        n = len(self.device_keys)
        if n == 1:
            return [batch_size], False
        if self.cost is not None:
            if batch_size not in self._sizes:
                self._sizes[batch_size] = solve(self.mode, batch_size, self.cost, self.limits)
                predicted = ", ".join(
                    f"{p / 2**20:.1f} MiB" if self.mode == "memory" else f"{p * 1e3:.1f} ms"
                    for p in self.cost.predict(self._sizes[batch_size])
                )
                log.info(
                    "balance=%r: batch %d split %s (predicted per device: %s)",
                    self.mode,
                    batch_size,
                    self._sizes[batch_size],
                    predicted,
                )
                note = self.limit_note(batch_size)
                if note is not None:
                    log.info("%s", note)
            return list(self._sizes[batch_size]), False
        if batch_size < 2 * n or not can_measure:  # too few rows to learn from, or no backward to see
            return split_sizes(batch_size, n), False
        self.calibration_calls += 1
        # the first call is a warm-up: optimizers create their state in their first step, which is not
        # typical; it is observed only to learn the optimizers whose state counts from then on
        return calibration_split(batch_size, n, self.measured_steps), True

    def limit_note(self, batch_size: int) -> str | None:
        """One line where memory balance cannot even the peaks out at this batch (a device's fixed share is the
        largest peak whatever the split): why, and the batch from which it can. None otherwise, or before the
        calibration has measured."""
        if self.mode != "memory" or self.cost is None or len(self.device_keys) < 2:
            return None
        rows = self._sizes.get(batch_size) or solve(self.mode, batch_size, self.cost, self.limits)
        limit = fixed_share_limit(rows, self.cost)
        if limit is None:
            return None
        n, mib = len(rows), 2**20
        return (
            f"balance='memory': {self.device_keys[limit.device]} holds {limit.fixed / mib:.1f} MiB whatever its rows "
            f"(parameters, summed gradients, optimizer state) and the other devices stay below it with {batch_size} "
            f"rows, so no split lowers the largest peak and the rows stay {rows}; from a batch of about "
            f"{limit.batch_to_reach} ({-(-limit.batch_to_reach // n)} per device) the others reach it and the peaks "
            "even out"
        )

    def record(self, sizes: Sequence[int], values: Sequence[float | None]) -> None:
        """One measured value per device (peak bytes, or compute seconds; None: nothing to learn)."""
        if self.calibration_calls == 1 and self.measured_steps == 0 and not self._warm_up_recorded:
            self._warm_up_recorded = True
            return
        for i, value in enumerate(values):
            if value is not None:
                self.points[i].append((int(sizes[i]), float(value)))
        self.measured_steps += 1
        if self.measured_steps >= self.steps_to_measure:
            self.cost = fit_cost(self.mode, self.points)
            self._sizes.clear()

    # what was learned, for a resumed run to split (and so round and draw dropout masks) as the saved one
    _STATE_FIELDS = ("points", "_sizes", "measured_steps", "calibration_calls", "_warm_up_recorded")

    def state_dict(self) -> dict[str, Any]:
        state = {name: getattr(self, name) for name in self._STATE_FIELDS}
        state["cost"] = (
            None if self.cost is None else {"fixed": list(self.cost.fixed), "per_row": list(self.cost.per_row)}
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self._STATE_FIELDS:
            if name in state:
                setattr(self, name, state[name])
        cost = state.get("cost")
        self.cost = None if cost is None else LinearCost(tuple(cost["fixed"]), tuple(cost["per_row"]))

    def values_from(self, sizes: Sequence[int], report: Report) -> list[float | None]:
        """The number per device that this mode balances, from an observed step's report."""
        values: list[float | None] = []
        for key, rows in zip(self.device_keys, sizes):
            try:
                entry = report.device(key)
            except KeyError:
                entry = None
            if self.mode == "memory":
                values.append(float(entry.peak_bytes) if entry is not None else 0.0)
            elif rows == 0 or entry is None:
                values.append(None)
            else:
                values.append(sum(entry.seconds_by_phase.get(phase, 0.0) for phase in COMPUTE_PHASES))
        return values


class MeasuredBalance(Balancer):
    """DataParallel's ChunkPlanner for balance=: observes the steps the calibration asks for."""

    def __init__(
        self, mode: str, devices: Sequence[torch.device], max_bytes_per_device: Sequence[float | None] | None = None
    ):
        super().__init__(mode, [device_key(d) for d in devices], max_bytes_per_device)
        self.primary_device = devices[0]
        self._measuring: tuple[Observer, list[int], weakref.finalize] | None = None
        self._optimizers: weakref.WeakSet = weakref.WeakSet()  # seen stepping in a measured step

    def chunk_sizes(self, batch_size: int, can_measure: bool) -> list[int]:
        sizes, measure = self.plan(batch_size, can_measure)
        if measure:
            # from this call to the next one: the whole step, backward and optimizer included
            observer = Observer(memory=True, timing=self.mode == "speed", trace=False).start()
            for optimizer in self._optimizers:  # its state is held all step long, not only in step()
                observer.watch_optimizer(optimizer, self.primary_device)
            # a wrapper dropped mid-measurement must not leave the observer running for the process
            self._measuring = (observer, sizes, weakref.finalize(self, observer.stop))
        return sizes

    def finish(self) -> None:
        if self._measuring is None:
            return
        observer, sizes, finalizer = self._measuring
        self._measuring = None
        finalizer.detach()
        observer.stop()
        self._optimizers.update(observer.optimizers_seen)
        self.record(sizes, self.values_from(sizes, observer.report()))

    def state_dict(self) -> dict[str, Any]:
        self.finish()  # a step being measured ends here rather than at the next forward
        return super().state_dict()

    def __getstate__(self) -> dict:
        # weak references and a running measurement do not pickle; the next steps learn them again
        state = dict(self.__dict__)
        state["_optimizers"], state["_measuring"] = None, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._optimizers = weakref.WeakSet()


def balance_notes(module: nn.Module, batch_size: int) -> list[str]:
    """The limit notes (Balancer.limit_note) of the measured balances of the DataParallel modules in `module`."""
    notes: list[str] = []
    for inner in module.modules():
        balancer = inner.balancer if isinstance(inner, DataParallel) else None
        note = balancer.limit_note(batch_size) if isinstance(balancer, Balancer) else None
        if note is not None:
            notes.append(note)
    return notes


hooks.set_balance_planner(MeasuredBalance)
