"""diloco: one process per device, each replica trained alone (the inner optimizer), and every `sync_every` steps
an outer optimizer step on the shared weights.

DiLoCo (Douillard et al., 2023): at each meeting (periodic.py) the replicas' averaged move since the last one, its
sign turned, is a pseudo-gradient for an outer SGD with Nesterov momentum (the paper: learning rate 0.7, momentum
0.9) on the weights they shared then; every replica continues from the outer step's result. With outer_lr=1 and
outer_momentum=0 the outer step is the average, and diloco is localsgd. The outer optimizer's state (its momentum)
is part of each process's saved state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dpkit.checks import check_number
from dpkit.strategies.base import ON_ROOT, PER_DEVICE, PERSISTENT, Traits
from dpkit.strategies.periodic import DEFAULT_SYNC_EVERY, PeriodicStrategy

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # the paper's


class DiLoCo(PeriodicStrategy):
    name = "diloco"
    traits = Traits(processes=PER_DEVICE, loss=ON_ROOT, replicas=PERSISTENT, sync_every=DEFAULT_SYNC_EVERY)
    options = PeriodicStrategy.options + ("outer_lr", "outer_momentum")

    def __init__(
        self,
        devices: Sequence[torch.device],
        *,
        outer_lr: float = OUTER_LR,
        outer_momentum: float = OUTER_MOMENTUM,
        **periodic_options: Any,
    ):
        check_number(outer_lr, "outer_lr", positive=True)
        check_number(outer_momentum, "outer_momentum")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum: expected a momentum in [0, 1), got {outer_momentum!r}")
        super().__init__(devices, **periodic_options)
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.outer: torch.optim.SGD | None = None
        self.shared: list[nn.Parameter] = []

    def wrap_model(self, model: nn.Module) -> nn.Module:
        wrapped = super().wrap_model(model)
        self.shared = [nn.Parameter(a.clone()) for a in self.anchor]
        nesterov = self.outer_momentum > 0
        self.outer = torch.optim.SGD(self.shared, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=nesterov)
        return wrapped

    def anchor_moved(self) -> None:
        for shared, anchor in zip(self.shared, self.anchor):
            shared.data.copy_(anchor)

    def meet(self, mean_move: list[torch.Tensor]) -> list[torch.Tensor]:
        assert self.outer is not None  # (made with the model)
        for shared, anchor, move in zip(self.shared, self.anchor, mean_move):
            shared.data.copy_(anchor)
            shared.grad = (-move).to(shared.dtype)  # the pseudo-gradient: the way back from the average
        self.outer.step()
        return [shared.detach().clone() for shared in self.shared]

    def layout(self) -> str:
        return (
            f"{self.name} every {self.sync_every} steps (outer lr {self.outer_lr:g}, momentum {self.outer_momentum:g})"
        )

    def own_state(self) -> dict[str, Any]:
        return {"outer": self.outer.state_dict() if self.outer is not None else None}

    def load_own_state(self, state: dict[str, Any]) -> None:
        if self.outer is not None and state.get("outer") is not None:
            self.outer.load_state_dict(state["outer"])
