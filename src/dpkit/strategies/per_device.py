"""What the strategies with one process per device share (ddp, fsdp, zero, hsdp); not a strategy itself.

`PerDeviceStrategy` checks that a launcher started this process, finds its device, and composes one
ProcessGroup (process_group.py: init, rendezvous, heartbeat, the user's collectives, the step marks, teardown)
configured by the frozen ProcessGroupOptions every per-device strategy takes; the data hooks give every process
its share of each global batch with the loss weight that makes the exchanged gradient the single-device one
(ProcessShares, process_shares.py). A strategy says where its step marks ride (`marks`) and wraps the model,
keeping what holds the process group in `self.wrapped`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import fields
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from dpkit.launch.environment import launched, missing_launch_variables, process_place
from dpkit.strategies.base import SaveCollectives, Strategy
from dpkit.strategies.process_group import ProcessGroup, ProcessGroupOptions
from dpkit.strategies.step_marks import MarksRide

T = TypeVar("T")


class PerDeviceStrategy(Strategy):
    """One process per device, joined in a process group (`self.group`): the data, the collectives and the
    teardown that ddp and fsdp share. A subclass wraps the model (keeping what holds the process group in
    `self.wrapped`) and passes where its step marks ride (`marks`, step_marks.py): a choice, not an option."""

    options: ClassVar[tuple[str, ...]] = tuple(option.name for option in fields(ProcessGroupOptions))

    def __init__(
        self, devices: Sequence[torch.device], marks: MarksRide, /, *, precision: str = "32", **group_options: Any
    ):
        options = ProcessGroupOptions(**group_options)  # (the registry checked the names)
        if not launched():
            raise RuntimeError(
                f"strategy='{self.name}' runs one process per device, and this process was not started by a launcher "
                f"({', '.join(missing_launch_variables())} unset); start the script with "
                f"`dpkit launch --nproc-per-node N script.py ...` (dpkit train --strategy {self.name} does this itself)"
            )
        super().__init__(devices, precision=precision)
        place = process_place()
        self.rank = place.rank
        self.world_size = place.world_size
        self.local_rank = place.local_rank
        # a launcher that does not say how many processes share this node: one per device given
        self.local_world_size = place.local_world_size or len(self.devices)
        if self.local_world_size != len(self.devices):
            raise ValueError(
                f"devices: {len(self.devices)} devices but the launcher started "
                f"{self.local_world_size} processes on this "
                f"node; pass devices={self.local_world_size} or launch with --nproc-per-node {len(self.devices)}"
            )
        self.device = self.devices[self.local_rank]
        self.group = ProcessGroup(self.rank, self.world_size, self.local_world_size, self.device, options, marks)
        self.wrapped: nn.Module | None = None  # the wrapped model, which holds on to the process group
        self._save_group: Any = None  # background saves' own process group (background_collectives)

    @property
    def root_device(self) -> torch.device:
        return self.device

    @property
    def marking_steps(self) -> bool:
        """Whether steps carry their marks; off only to measure their cost (benchmarks/collective_record_cost.py)."""
        return self.group.marks.marking_steps

    @marking_steps.setter
    def marking_steps(self, marking: bool) -> None:
        self.group.marks.marking_steps = marking

    def setup_environment(self) -> None:
        self.group.start()

    # --- the data: ProcessShares, with rank 0's seed ----------------------------------------------------
    def global_batches(self, loader: DataLoader) -> Iterable[list[int]] | None:
        return self.group.shares().global_batches(loader)

    def batch_share(self, indices: list[int]) -> list[int]:
        return self.group.shares().batch_share(indices)

    def loss_weight(self, rows: int, global_rows: int) -> float:
        return self.group.loss_weight(rows, global_rows)

    # --- collectives -------------------------------------------------------------------------------
    def all_gather_object(self, obj: T) -> list[T]:
        return self.group.all_gather_object(obj)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self.group.all_reduce(tensor, op)

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_rows(tensor)

    def barrier(self) -> None:
        self.group.barrier()

    def background_collectives(self) -> SaveCollectives:
        """A gloo group of its own, made by every process at its first background save (every process saves at the
        same point), so that a save's agreement and its shards never interleave with the training's collectives."""
        import torch.distributed as dist

        if self._save_group is None:
            self._save_group = dist.new_group(backend="gloo")
        group = self._save_group

        def gather(value: Any) -> list[Any]:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, value, group=group)
            return gathered

        return SaveCollectives(lambda: dist.barrier(group=group), gather, group)

    def teardown(self) -> None:
        self.group.close(self.wrapped)
        self.wrapped = None
