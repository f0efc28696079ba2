"""The memory table of a plan: every strategy asked, and each variant it plans, on the most devices it uses, with the
fullest device's predicted bytes by category (memory.py) and what it shards over how many processes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from dpkit.plan.configuration import BatchSize, Hardware, Setup
from dpkit.plan.constants import CostConstants
from dpkit.plan.cost_model import taken
from dpkit.plan.memory import memory_by_category
from dpkit.plan.profiles import ModelProfile
from dpkit.strategies import PER_DEVICE, strategy_class
from dpkit.strategies.compression import Compression

# the memory table's columns: (header, the categories of memory.MEMORY_CATEGORIES added up in it, legend)
MEMORY_COLUMNS = (
    ("params", ("parameters",), "the weights kept between steps"),
    ("grads", ("gradients",), "the gradients after the exchange"),
    ("optim", ("optimizer_state",), "the optimizer's state"),
    (
        "gathered",
        ("gathered_parameters",),
        "weights gathered whole, a unit's gradient before its reduce-scatter",
    ),
    (
        "copies",
        ("gradient_buckets", "autocast_copies", "compression_state"),
        "DDP's gradient buckets, autocast's 16-bit weights and PowerSGD's error feedback",
    ),
    ("activ", ("activations", "gathered_outputs"), "activations, outputs, and outputs gathered on device 0"),
)


@dataclass
class MemoryRow:
    """A strategy (with options: a variant the strategy plans, such as zero's stage=2) on the most devices it uses
    of a plan: the fullest device's predicted bytes by category, and what it shards over how many processes."""

    strategy: str
    options: dict[str, Any]
    devices: int  # per node
    nodes: int
    bytes_by_category: dict[str, int]
    sharded_parts: tuple[str, ...]
    shard_size: int
    replicas_of_a_shard: int

    @property
    def label(self) -> str:
        return " ".join([self.strategy, *(f"{key}={value}" for key, value in sorted(self.options.items()))])

    @property
    def peak_bytes(self) -> int:
        return sum(self.bytes_by_category.values())

    @property
    def shards(self) -> str:
        """What it shards over how many processes: "w,g,o/8", "o/8", "w,g,o/4 x2" (replicated twice), "-"."""
        if not self.sharded_parts:
            return "-"
        parts = ",".join({"weights": "w", "gradients": "g", "optimizer_state": "o"}[p] for p in self.sharded_parts)
        return f"{parts}/{self.shard_size}" + (f" x{self.replicas_of_a_shard}" if self.replicas_of_a_shard > 1 else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "options": dict(self.options),
            "devices": self.devices,
            "nodes": self.nodes,
            "sharded": list(self.sharded_parts),
            "shard_size": self.shard_size,
            "bytes_by_category": dict(self.bytes_by_category),
            "peak_bytes": self.peak_bytes,
        }


def memory_rows(
    profile: ModelProfile,
    hardware: Hardware,
    strategies: list[str],
    device_counts: list[int],
    batch: BatchSize,
    precision: str = "32",
    constants: CostConstants = CostConstants(),
    optimizer: str = "adam",
    strategy_options: Mapping[str, Mapping[str, Any]] | None = None,
    compression: Compression | None = None,
) -> list[MemoryRow]:
    """Every strategy asked, and each variant it plans (Strategy.planned_variants), on the most devices it can use
    of `device_counts` (per node; nodes as in predict_all): the fullest device's memory by category, with
    `compression` where the variant takes it. A strategy given `strategy_options` (by its name) is planned with
    those alone."""
    rows = []
    for name in strategies:
        cls = strategy_class(name)
        given = (strategy_options or {}).get(name)
        for options in (given,) if given else ({}, *cls.planned_variants):
            traits = cls.traits_for(**options)
            one_device = traits.max_devices == 1
            spans_nodes = traits.processes == PER_DEVICE and not one_device
            if hardware.nodes > 1 and not spans_nodes and not one_device:
                continue  # one process cannot drive another node's devices
            usable = [n for n in device_counts if traits.max_devices is None or n <= traits.max_devices]
            if not usable:
                continue
            machine = replace(hardware, nodes=hardware.nodes if spans_nodes else 1)
            devices = max(usable)
            setup = Setup(
                profile,
                machine,
                name,
                devices,
                batch.share(devices * machine.nodes),
                precision,
                constants,
                optimizer,
                dict(options),
                compression=taken(compression or Compression(), traits),
            )
            fullest = max(memory_by_category(setup), key=lambda account: sum(account.values()))
            sharded = traits.sharded_parts
            rows.append(
                MemoryRow(
                    name,
                    dict(options),
                    devices,
                    machine.nodes,
                    fullest,
                    sharded,
                    setup.shard_size,
                    setup.replicas_of_a_shard if sharded else 1,
                )
            )
    return rows
