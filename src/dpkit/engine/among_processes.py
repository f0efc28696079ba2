"""Where an Engine's process stands among the others, and what it does with them: its devices, rank and world
size; values reduced, rows and objects gathered, barriers; progress bars and prints from rank 0 only.

A base of the Engine (engine/engine.py), kept apart from the loop API: everything here reads only the
Engine's placement and strategy, and works the same before and after setup.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from tqdm import tqdm

if TYPE_CHECKING:
    from dpkit.engine.placement import Placement
    from dpkit.strategies import Strategy

T = TypeVar("T")


class AmongProcesses:
    placement: Placement
    strategy: Strategy
    show_progress: bool

    @property
    def in_shadow_step(self) -> bool:
        """Whether this process sits out the step in hand: its per-process stream ran out while others' did not
        (uneven="join"); its batch is its last one again, weighing nothing, and reduce and gather leave it out."""
        return False

    # --- where we are ------------------------------------------------------------------------------
    @property
    def devices(self) -> list[torch.device]:
        """The devices the strategy runs on (this node's, under a strategy with a process per device)."""
        return list(self.placement.devices)

    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def world_size(self) -> int:
        return self.placement.processes

    @property
    def is_global_zero(self) -> bool:
        return self.placement.rank == 0

    @property
    def device(self) -> torch.device:
        """Where this process's model lives and where its batches go."""
        return self.strategy.root_device

    # --- metrics across processes ------------------------------------------------------------------
    def reduce(self, value: torch.Tensor | float, op: str = "mean", *, weight: float | None = None) -> torch.Tensor:
        """`value` combined over processes: "sum", "mean", or with weight= the weight-averaged mean
        (e.g. a per-process mean loss with weight=len(y) gives the mean over all samples)."""
        if op not in ("mean", "sum"):
            raise ValueError(f"op: expected 'mean' or 'sum', got {op!r}")
        tensor = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value, dtype=torch.float64)
        if self.in_shadow_step:  # a rank sitting out a step (uneven="join") adds nothing to a sum or weighted mean
            tensor = torch.zeros_like(tensor)
            weight = None if weight is None else 0.0
        if weight is not None:
            if op != "mean":
                raise ValueError("weight: only op='mean' takes a weight")
            weights = self.strategy.all_reduce(torch.as_tensor(float(weight), dtype=torch.float64), "sum")
            return self.strategy.all_reduce(tensor * float(weight), "sum") / weights
        return self.strategy.all_reduce(tensor, op)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rows from every process in global-batch order; with engine.setup_dataloader each sample once."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            raise TypeError("tensor: expected a tensor with a batch dimension (rows) to gather")
        if self.in_shadow_step:  # a rank sitting out a step (uneven="join") gives no rows
            tensor = tensor[:0]
        return self.strategy.all_gather_rows(tensor)

    def barrier(self) -> None:
        self.strategy.barrier()

    def gather_object(self, obj: T) -> list[T]:
        """Every process's `obj` (picklable, e.g. an observe.Report), in rank order; [obj] in one process."""
        return self.strategy.all_gather_object(obj)

    # --- rank-0 output -----------------------------------------------------------------------------
    def progress(self, iterable: Iterable[T] | None = None, **tqdm_kwargs: Any) -> tqdm[T]:
        """A tqdm bar, shown on rank 0 only (and only with progress=True)."""
        disable = not (self.show_progress and self.is_global_zero) or tqdm_kwargs.pop("disable", False)
        return tqdm(iterable, disable=disable, **tqdm_kwargs)

    def print(self, *args: object, **kwargs: Any) -> None:
        """print(), on rank 0 only."""
        if self.is_global_zero:
            print(*args, **kwargs)
