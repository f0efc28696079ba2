"""Where a run runs, resolved once: the strategy, its devices, the process group and the precision.

    placement = resolve_placement("auto", accelerator="cpu", devices=2, precision="32")
    strategy = create_strategy(placement.strategy, placement.devices, precision=placement.precision)

Everything that asks "which strategy, on which devices, as which process" reads a Placement instead of
the arguments, the launch variables or the strategy's class: it is made here, in one place, from the
arguments a caller was given (the Engine's, or `dpkit train`'s) and this process's place in its launched
group (dpkit.launch.environment.process_place, the only reading of RANK / WORLD_SIZE / LOCAL_RANK), and it
is frozen. In-process `auto` on several devices cannot decide before it sees a batch: its placement runs
the reference strategy on the first device and lists the devices to choose among (`auto_devices`); the
decision makes a new Placement (`decided`), it never changes the old one.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard, cast

import torch

from dpkit.devices import DeviceLike, resolve_devices
from dpkit.launch.environment import ProcessPlace, launched, process_place
from dpkit.precision import PRECISIONS
from dpkit.strategies import PER_DEVICE, reference, strategy_class

if TYPE_CHECKING:  # the planner is imported only by a process that made a Choice (see is_choice)
    from dpkit.plan.auto import Choice


@dataclass(frozen=True)
class Placement:
    """Where this process's part of a run runs, as its strategy is built with it.

    strategy: a registered strategy's name (never "auto": see auto_devices).
    devices: the devices the strategy is built on; under a strategy with a process per device, this node's
        devices, of which this process drives devices[local_rank].
    processes: the world size (1 for the strategies that drive every device from one process).
    rank, local_rank, node_rank: this process's place in its group (0, 0, 0 in one process).
    precision: "32", "bf16-mixed" or "16-mixed".
    auto_devices: under in-process strategy="auto" before its first batch, the devices the choice is made
        among (the placement meanwhile runs the reference strategy on the first); () once decided.
    """

    strategy: str
    devices: tuple[torch.device, ...]
    processes: int = 1
    rank: int = 0
    local_rank: int = 0
    node_rank: int = 0
    precision: str = "32"
    auto_devices: tuple[torch.device, ...] = ()

    @property
    def device(self) -> torch.device:
        """The device this process keeps its model on and sends its batches to."""
        return self.devices[self.local_rank] if self.per_device else self.devices[0]

    @property
    def per_device(self) -> bool:
        """Whether the strategy runs one process per device (this process drives one of `devices`)."""
        return strategy_class(self.strategy).traits.processes == PER_DEVICE

    @property
    def undecided(self) -> bool:
        """Whether in-process `auto` still chooses the strategy from the first batch."""
        return bool(self.auto_devices)

    def decided(self, strategy: str, devices: Sequence[torch.device]) -> Placement:
        """The placement once in-process `auto` chose `strategy` on `devices` (a one-process strategy)."""
        return dataclasses.replace(self, strategy=strategy, devices=tuple(devices), auto_devices=())


def is_choice(strategy: object) -> TypeGuard[Choice]:
    """Whether `strategy` is the Choice dpkit.choose_strategy returned (without importing the planner: a
    process that holds a Choice has imported it already)."""
    auto = sys.modules.get("dpkit.plan.auto")
    return auto is not None and isinstance(strategy, auto.Choice)


def resolve_placement(
    strategy: str | Choice,
    accelerator: str = "auto",
    devices: int | str | Sequence[DeviceLike] = "auto",
    precision: str = "32",
    *,
    place: ProcessPlace | None = None,
) -> Placement:
    """The Placement for these arguments in this process: the one place a run's strategy, devices and rank are
    decided.

    strategy: a registered name; "auto" (one device: the reference strategy; a launched group of several
        processes: ddp; several devices in one process: the reference on the first device until the first
        batch decides, with the devices listed in auto_devices); or the Choice dpkit.choose_strategy returned
        (its strategy, on one device when it chose one and this process was not launched).
    accelerator, devices: as dpkit.devices.resolve_devices takes them; devices="auto" under a strategy that
        runs on at most N devices is N.
    precision: one of "32", "bf16-mixed", "16-mixed" (whether the device supports it is precision.Precision's
        check, made when the precision is applied).
    place: this process's place in its launched group; None reads it from the launcher's environment
        (dpkit.launch.environment.process_place). Only a strategy with a process per device takes its
        processes and ranks from it: the others run as rank 0 of 1.

    Raises ValueError naming the argument for an unknown strategy, accelerator, device list or precision.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    place = process_place() if place is None else place
    in_a_group = place.world_size > 1 or launched()
    auto_devices: list[torch.device] = []
    if is_choice(strategy):
        name = strategy.strategy
        if strategy.devices == 1 and not in_a_group:
            devices = resolve_devices(accelerator, devices)[:1]
    elif strategy == "auto":
        if place.world_size > 1:  # a launcher started a process per device
            name = "ddp"
        else:
            resolved = resolve_devices(accelerator, devices)
            name, devices = reference(), resolved[:1]
            if len(resolved) > 1:
                auto_devices = resolved
    else:
        name = cast(str, strategy)
        strategy_class(name)  # an unknown name (or not a name): one line naming the argument and the choices
    traits = strategy_class(name).traits
    if isinstance(devices, str) and devices == "auto" and traits.max_devices is not None:
        devices = traits.max_devices
    resolved_devices = tuple(resolve_devices(accelerator, devices))
    if traits.processes != PER_DEVICE:
        return Placement(name, resolved_devices, precision=precision, auto_devices=tuple(auto_devices))
    _check_processes_match_devices(place, resolved_devices, launched_here=in_a_group)
    return Placement(
        name,
        resolved_devices,
        processes=place.world_size,
        rank=place.rank,
        local_rank=place.local_rank,
        node_rank=place.node_rank,
        precision=precision,
    )


def _check_processes_match_devices(
    place: ProcessPlace, devices: Sequence[torch.device], *, launched_here: bool
) -> None:
    """Refuse a device list that is not one device per process of this node, before anything indexes it.

    Every rank of the group reads the same launcher variables and the same arguments, so every rank refuses
    with the same line (exit 2 from the CLI, not retried), and no rank dies of an IndexError while another names
    the cause. A launcher that does not say how many processes share the node (local_world_size None) is taken
    at its word: one process per device given.
    """
    if not launched_here:
        return
    processes = place.local_world_size or len(devices)
    if processes != len(devices):
        raise ValueError(
            f"devices: {len(devices)} devices but the launcher started {processes} processes on this node; "
            f"pass devices={processes} or launch with --nproc-per-node {len(devices)}"
        )
