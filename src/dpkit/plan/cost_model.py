"""The cost model: one training step of a profiled model, phase by phase, under each strategy, and its memory.

Every phase is computation (FLOPs at the achieved rate), memory traffic (bytes at the device's memory
bandwidth), a transfer (alpha + bytes / beta over a link: the alpha-beta model), or host time: launching
kernels (the catalogue's figure per GPU), DataParallel re-making its replicas per module and per parameter tensor
at every step, handing the replica threads their work, the replica threads of one process taking turns on the
GIL (CostConstants; a calibration fits them). The formulas, with their sources, are in docs/cost-model.md;
these modules are that page in code:

    configuration.py   what is predicted: Hardware, BatchSize, Setup (the one value the pieces take)
    constants.py       CostConstants, and what a strategy keeps and moves per parameter
    transfers.py       alpha-beta: a message, through one root, around a ring
    step_time.py       step_breakdown: the terms the strategy's traits contribute to one step, added up
    communication.py   the collectives the traits' sharding decides, and what of them is exposed
    memory.py          each device's bytes by category, the largest batch that fits, Sizing
    cost_model.py      (this module) a Prediction for one configuration, or every strategy and device count

A strategy's phases and memory follow from its traits (dpkit.strategies.base.Traits), never from its
name: whether one process drives several replicas, whether they are copied every step or persist,
where the loss runs, whether it spans nodes, which parts of its state (weights, gradients, optimizer state) it
shards over which group of processes, and how it gathers sharded weights. A new strategy is predicted from the
traits it declares (with its options: Strategy.traits_for).

    hardware = Hardware(catalogue.gpu("h100-sxm"), catalogue.link("nvlink4"))
    prediction = predict(profile, hardware, "ddp", devices=8, batch_per_device=32)
    prediction.step_seconds, prediction.breakdown   # {"forward": ..., "all_reduce": ..., ...}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dpkit.plan.configuration import BatchSize, Hardware, Setup, as_batch, runs_at
from dpkit.plan.constants import OPTIMIZER_STATE_BYTES_PER_PARAMETER, CostConstants
from dpkit.plan.memory import largest_batch_per_device, memory_per_device
from dpkit.plan.profiles import ModelProfile
from dpkit.plan.step_time import step_breakdown
from dpkit.strategies import PER_DEVICE, Traits, reference, strategy_class
from dpkit.strategies.compression import Compression, parse_compression


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
    compress: str = "none"  # the gradient compression it was predicted with (none where the strategy takes none)
    accumulate: int = 1  # micro-batches per optimizer step: the step's time and samples are the K micro-batches'

    @property
    def total_devices(self) -> int:
        return self.devices * self.nodes

    @property
    def label(self) -> str:
        """The strategy with the options it was predicted with: "zero stage=2", "hsdp shard_size=2"."""
        return " ".join([self.strategy, *(f"{key}={value}" for key, value in sorted(self.options.items()))])

    @property
    def batch(self) -> int:
        """The samples of one step, over every device."""
        return self.global_batch if self.global_batch is not None else self.batch_per_device * self.total_devices

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "options": dict(self.options),
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
            "compress": self.compress,
            "accumulate": self.accumulate,
            "breakdown": dict(self.breakdown),
            "notes": list(self.notes),
        }


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
    *,
    compression: str | Compression | None = None,
    accumulate: int = 1,
) -> Prediction:
    """One configuration (see Setup; `options`: the strategy's). `global_batch`: the samples of one micro-batch in
    all, split across the devices, the fullest taking `batch_per_device` (their largest share), which sets the step
    time and the peak memory. `compression`: one the strategy takes ("bf16", "powersgd:4", ...); `accumulate`:
    micro-batches per optimizer step."""
    setup = Setup(
        profile,
        hardware,
        strategy,
        devices,
        batch_per_device,
        precision,
        constants,
        optimizer,
        dict(options or {}),
        compression=parse_compression(compression),
        accumulate=accumulate,
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
    check_compression(setup.compression, setup.strategy, setup.traits)
    if isinstance(setup.accumulate, bool) or not isinstance(setup.accumulate, int) or setup.accumulate < 1:
        raise ValueError(f"accumulate: expected a positive number of micro-batches per step, got {setup.accumulate!r}")
    breakdown = step_breakdown(setup)
    step = sum(breakdown.values())
    peaks, _ = memory_per_device(setup)
    largest = largest_batch_per_device(setup)
    micro_batch = setup.batch_per_device * setup.processes if global_batch is None else global_batch
    samples = micro_batch * setup.accumulate
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
        compress=str(setup.compression) if setup.processes > 1 else "none",
        accumulate=setup.accumulate,
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


def check_compression(compression: Compression, strategy: str, traits: Traits) -> None:
    """A compression the strategy does not take: one line naming what it takes."""
    if compression.kind not in traits.compressions:
        raise ValueError(
            f"compress: strategy {strategy!r} takes {', '.join(traits.compressions)}; got {str(compression)!r}"
        )


def compression_takers(
    compression: Compression, strategies: Sequence[str], options: Mapping[str, Mapping[str, Any]] | None = None
) -> list[str]:
    """Those of `strategies` (with their `options`, by name) that take `compression`."""
    return [
        name
        for name in strategies
        if compression.kind in strategy_class(name).traits_for(**(options or {}).get(name, {})).compressions
    ]


def taken(compression: Compression, traits: Traits) -> Compression:
    """The compression a strategy is predicted with: the one asked where it takes it, else none."""
    return compression if compression.kind in traits.compressions else Compression()


def predict_all(
    profile: ModelProfile,
    hardware: Hardware,
    strategies: list[str],
    device_counts: list[int],
    batch_per_device: int | BatchSize,
    precision: str = "32",
    constants: CostConstants = CostConstants(),
    optimizer: str = "adam",
    strategy_options: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    compression: str | Compression | None = None,
    accumulate: int = 1,
) -> list[Prediction]:
    """Every strategy at every device count it can use (only strategies with a process per device, such
    as ddp, span nodes), with speed-up and efficiency against the reference strategy on one device of one node
    (with a global batch: that device running the whole batch). A plain number is a batch per device.
    `strategy_options`: a strategy's options by its name (zero's stage, hsdp's shard_size); its defaults else.
    `compression`: the strategies that take it are predicted with it, the others uncompressed with a note;
    `accumulate`: micro-batches per optimizer step, the reference's too."""
    batch = as_batch(batch_per_device)
    chosen = strategy_options or {}
    asked = parse_compression(compression)

    def predict_batch(machine: Hardware, strategy: str, devices: int) -> Prediction:
        total = devices * machine.nodes
        applied = taken(asked, strategy_class(strategy).traits_for(**chosen.get(strategy, {})))
        prediction = predict(
            profile,
            machine,
            strategy,
            devices,
            batch.share(total),
            precision,
            constants,
            optimizer,
            global_batch=None if batch.per_device else batch.samples,
            options=chosen.get(strategy),
            compression=applied,
            accumulate=accumulate,
        )
        if asked.compresses and not applied.compresses and total > 1:
            prediction.notes.append(f"takes no {asked}: predicted uncompressed")
        return prediction

    baseline = predict_batch(replace(hardware, nodes=1), reference(), 1)
    predictions = []
    for strategy in strategies:
        traits = strategy_class(strategy).traits_for(**chosen.get(strategy, {}))
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
