"""What a plan was asked, and the plan re-run with one change: another machine or batch (what would change the
answer), another compression for one configuration (what compression pays), and from which batch a strategy
outruns one device (payoff.py). The advisor asks these through the callables `recommend` takes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from dpkit.plan.catalogue import Link
from dpkit.plan.configuration import BatchSize, Hardware
from dpkit.plan.constants import CostConstants
from dpkit.plan.cost_model import Prediction, predict, predict_all
from dpkit.plan.payoff import MOST_SAMPLES, break_even_batch
from dpkit.plan.profiles import ModelProfile
from dpkit.strategies.compression import Compression


@dataclass(frozen=True)
class Reruns:
    """A plan's inputs (make_plan's), and the plan re-run with a change."""

    profile: ModelProfile
    hardware: Hardware
    strategies: list[str]
    device_counts: list[int]
    batch: BatchSize
    precision: str
    constants: CostConstants
    optimizer: str
    strategy_options: Mapping[str, Mapping[str, Any]]
    links: Mapping[str, Link]  # the catalogue's: the faster link is one of the GPU's
    networks: Mapping[str, Link]
    compression: Compression
    accumulate: int

    def predictions(self, machine: Hardware | None = None, batch: BatchSize | None = None) -> list[Prediction]:
        """Every strategy at every device count, on `machine` at `batch` (the plan's own by default)."""
        return predict_all(
            self.profile,
            machine or self.hardware,
            self.strategies,
            self.device_counts,
            batch or self.batch,
            self.precision,
            self.constants,
            self.optimizer,
            self.strategy_options,
            compression=self.compression,
            accumulate=self.accumulate,
        )

    def compressed(self, prediction: Prediction, compression: Compression) -> Prediction:
        """One configuration of the plan predicted with another compression."""
        return predict(
            self.profile,
            replace(self.hardware, nodes=prediction.nodes),
            prediction.strategy,
            prediction.devices,
            prediction.batch_per_device,
            self.precision,
            self.constants,
            self.optimizer,
            prediction.global_batch,
            prediction.options,
            compression=compression,
            accumulate=self.accumulate,
        )

    def what_if(self, change: str, devices: int) -> tuple[str, list[Prediction]] | None:
        """The plan re-run with one of advisor.CHANGES, the change in words; None where it does not apply."""
        hardware = self.hardware
        if change == "faster-link":
            gpu_links = {name: self.links[name] for name in hardware.gpu.links if name in self.links}
            link = faster_link(hardware, gpu_links, devices)
            if link is None:
                return None
            words = f"{link.name}, the fastest link for {hardware.gpu.name}"
            return words, self.predictions(replace(hardware, link=link, interprocess=None))
        if change == "faster-network":
            if hardware.nodes < 2 or not self.networks or hardware.network is None:
                return None
            fastest = max(self.networks.values(), key=lambda link: link.achieved_bytes_per_second)
            if fastest.achieved_bytes_per_second <= hardware.network.achieved_bytes_per_second:
                return None
            return f"{fastest.name}, the fastest network", self.predictions(replace(hardware, network=fastest))
        if change == "double-batch":
            doubled = self.batch.doubled()
            per_device = " per device" if self.batch.per_device else ""
            return f"twice the batch{per_device} ({doubled.samples})", self.predictions(batch=doubled)
        return None

    def payoff(self, strategy: str, devices: int) -> str | None:
        """From which batch `strategy` on `devices` devices outruns one device, in the plan's batch terms."""
        if self.hardware.nodes > 1:
            return None
        pays = break_even_batch(
            self.profile,
            self.hardware,
            strategy,
            devices,
            self.precision,
            self.constants,
            self.optimizer,
            per_device=self.batch.per_device,
        )
        unit = "per device" if self.batch.per_device else "in all"
        if pays is None:
            return f"it does not pay at any batch up to {MOST_SAMPLES:,} {unit}"
        return f"it would pay from a batch of {pays:,} {unit}"


def faster_link(hardware: Hardware, links: Mapping[str, Link], devices: int) -> Link | None:
    """The fastest of `links` that joins `devices` devices and is faster than the hardware's own (None if none)."""
    joining = [link for link in links.values() if link.max_devices is None or link.max_devices >= devices]
    fastest = max(joining, key=lambda link: link.achieved_bytes_per_second, default=None)
    if fastest is None or fastest.achieved_bytes_per_second <= hardware.link.achieved_bytes_per_second:
        return None
    return fastest
