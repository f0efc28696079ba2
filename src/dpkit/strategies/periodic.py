"""Synchronizing every H steps: the piece `localsgd` and `diloco` share (not a strategy itself).

Each process trains its own replica on its share of every global batch with its own optimizer, no gradient
crossing between steps; every `sync_every` optimizer steps the replicas meet. What each process moved since the
last meeting (its weights minus the anchor, the weights all shared then) is averaged over the processes, weighted
by the rows each trained on in the period, through the compressed exchange (compressed_sum.py: `compress=` applies
to it); then the strategy's `meet` makes the new shared weights from the anchor and that average (localsgd: their
sum; diloco: an outer optimizer step that takes the averaged move as its negative gradient), and every replica and
the anchor take them. With H = 1, plain SGD and uneven shares, localsgd's meeting gives exactly the single device's
step (each replica's step is its own rows' mean gradient; the rows-weighted average of the steps is the step on
the union).

Each meeting also measures how far the replicas drifted apart: the largest difference of a replica's weights from
the average, relative to the average's largest weight (`spreads`, one per meeting, the largest over processes).

A process's own part of the run (its replica's weights and optimizer state mid-period, the anchor, the outer
optimizer's state, the step within the period and the rows in it) is its `process_state`: a state saved mid-period
resumes bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from dpkit.checks import check_int
from dpkit.observe.collectives import RECORD
from dpkit.parallel import hooks
from dpkit.strategies.base import StrategyOptimizer, Traits
from dpkit.strategies.compressed_buckets import ProcessPeers
from dpkit.strategies.compressed_sum import CompressedSum
from dpkit.strategies.per_device import PerDeviceStrategy
from dpkit.strategies.single import one_device_forward
from dpkit.strategies.step_marks import IN_FIRST_BUCKET

DEFAULT_SYNC_EVERY = 8


def check_sync_every(sync_every: object) -> int:
    check_int(sync_every, "sync_every", meaning="optimizer steps between the replicas' meetings")
    return int(sync_every)  # type: ignore[call-overload]


class PeriodicOptimizer:
    """The user's optimizer, stepping this replica alone; every `sync_every` steps the strategy's meeting."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: PeriodicStrategy):
        self.optimizer = optimizer
        self.strategy = strategy
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self, closure: Any = None) -> Any:
        result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.strategy.stepped()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)


class PeriodicStrategy(PerDeviceStrategy):
    """A replica per process, meeting every `sync_every` steps (see the module doc); `meet` is the strategy's own."""

    options = PerDeviceStrategy.options + ("sync_every",)

    @classmethod
    def traits_for(cls, **options: Any) -> Traits:
        traits = super().traits_for(**options)
        return replace(traits, sync_every=check_sync_every(options.get("sync_every", DEFAULT_SYNC_EVERY)))

    def __init__(self, devices: Sequence[torch.device], *, sync_every: int = DEFAULT_SYNC_EVERY, **group_options: Any):
        super().__init__(devices, IN_FIRST_BUCKET, **group_options)  # (the marks go alone, at each meeting)
        self.sync_every = check_sync_every(sync_every)
        self.traits = self.traits_for(sync_every=self.sync_every)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.anchor: list[torch.Tensor] = []  # the weights every replica shared at the last meeting
        self.steps_in_period = 0
        self.rows_in_period = 0
        self.spreads: list[float] = []  # each meeting's drift (see the module doc)
        self.exchange = CompressedSum(self.group.options.compression, seed=self.group.options.seed)

    # --- wrapping ---------------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        self.model = model.to(self.device)
        self.anchor = [p.detach().clone() for p in self.model.parameters()]
        self.wrapped = self.model  # (what engine.close's teardown keeps: nothing holds the process group)
        return self.model

    def weights_loaded(self) -> None:
        """Weights loaded into the model (the same in every process): the replicas meet there, a new period."""
        if self.model is not None:
            self.anchor = [p.detach().clone() for p in self.model.parameters()]
            self.steps_in_period = self.rows_in_period = 0
            self.anchor_moved()

    def anchor_moved(self) -> None:
        """The anchor was set anew (diloco's shared weights follow)."""

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> PeriodicOptimizer:
        self.optimizer = optimizer
        return PeriodicOptimizer(optimizer, self)

    def forward_context(self, args: tuple, kwargs: dict) -> AbstractContextManager:
        return one_device_forward(self.model, self.device, args, kwargs)

    # --- the step: this replica alone; its rows counted for the meeting's weights --------------------------
    def loss_weight(self, rows: int, global_rows: int) -> float:
        return 1.0  # each replica steps on its own rows' mean

    def rows_trained(self, rows: int) -> None:
        self.rows_in_period += rows

    def items_in_step(self, items: float) -> float:
        return items  # each replica steps on its own items

    def sum_weight(self) -> float:
        return 1.0

    def backward(self, loss: torch.Tensor, *, scale: float, sync: bool) -> None:
        if sync:
            RECORD.steps += 1
        with hooks.phase("backward", self.device):
            (loss * scale if scale != 1.0 else loss).backward()

    def stepped(self) -> None:
        """After each optimizer step of this replica: the meeting when the period is complete."""
        self.steps_in_period += 1
        if self.steps_in_period >= self.sync_every:
            self.sync()

    # --- the meeting ----------------------------------------------------------------------------------------
    def sync(self) -> None:
        """Every replica and the anchor take the new shared weights (see the module doc)."""
        assert self.model is not None  # (set up: the optimizer steps a wrapped model)
        params = list(self.model.parameters())
        names = [name for name, _ in self.model.named_parameters()]
        with hooks.phase("average", self.device), RECORD.exchanging_gradients(), torch.no_grad():
            self.group.marks.all_reduce_marks_alone()
            rows = self.group.all_reduce(torch.tensor(float(self.rows_in_period), dtype=torch.float64), "sum")
            # rows weighted; a loop that does not go through the Engine's loaders counts no rows: equal weights then
            share = self.rows_in_period * self.world_size / float(rows) if float(rows) > 0 else 1.0
            moved = [(p.detach().float() - a.float()) * share for p, a in zip(params, self.anchor)]
            peers = ProcessPeers(self.world_size)
            with RECORD.issuing(f"all_reduce of the replicas' moves ({self.exchange.compression})") as entry:
                mean = self.exchange(names, [moved], peers)
                if entry is not None:
                    entry.size_bytes = peers.sent_bytes
            average = [a.float() + m.view_as(a) for a, m in zip(self.anchor, mean)]
            drift = max(float((p.detach().float() - w).abs().max()) for p, w in zip(params, average))
            scale = max(float(w.abs().max()) for w in average)
            spreads = torch.zeros(self.world_size, dtype=torch.float64)
            spreads[self.rank] = drift / max(scale, 1e-30)
            spreads = self.group.all_reduce(spreads, "sum")  # every process's, to take the largest
            new = self.meet([m.view_as(a) for a, m in zip(self.anchor, mean)])
            for p, w, a in zip(params, new, self.anchor):
                p.copy_(w)
                a.copy_(w)
        self.spreads.append(float(spreads.max()))
        self.exchange.step_done()
        self.steps_in_period = self.rows_in_period = 0

    def meet(self, mean_move: list[torch.Tensor]) -> list[torch.Tensor]:
        """The new shared weights from the anchor and the replicas' averaged move."""
        raise NotImplementedError

    # --- a process's own part of the run ------------------------------------------------------------------
    def own_state(self) -> dict[str, Any]:
        """What only this strategy keeps (diloco adds its outer optimizer)."""
        return {}

    def load_own_state(self, state: dict[str, Any]) -> None:
        """Restore what own_state() returned."""

    def process_state(self) -> dict[str, Any] | None:
        if self.model is None:
            return None
        return {
            "periodic": {
                "sync_every": self.sync_every,
                "steps_in_period": self.steps_in_period,
                "rows_in_period": self.rows_in_period,
                "replica": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "anchor": [a.detach().cpu().clone() for a in self.anchor],
                "spreads": list(self.spreads),
                "exchange": self.exchange.state_dict(),
                **self.own_state(),
            }
        }

    def load_process_state(self, state: dict[str, Any]) -> str | None:
        saved = state.get("periodic")
        if saved is None or self.model is None:
            return "saved by another strategy"
        if saved["sync_every"] != self.sync_every:
            return f"saved meeting every {saved['sync_every']} steps, this run every {self.sync_every}"
        self.model.load_state_dict(saved["replica"])
        if self.optimizer is not None and saved["optimizer"] is not None:
            self.optimizer.load_state_dict(saved["optimizer"])
        self.anchor = [a.to(self.device) for a in saved["anchor"]]
        self.steps_in_period, self.rows_in_period = saved["steps_in_period"], saved["rows_in_period"]
        self.spreads = list(saved["spreads"])
        self.exchange.load_state_dict(saved["exchange"], self.device)
        self.load_own_state(saved)
        return None

    def run_metrics(self) -> dict[str, Any]:
        return {"parameter_spread": list(self.spreads)}

    def optimizer_state(self, optimizer: StrategyOptimizer) -> dict[str, Any] | None:
        return optimizer.state_dict() if self.rank == 0 else None
