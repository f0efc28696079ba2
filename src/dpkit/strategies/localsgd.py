"""localsgd: one process per device, each replica trained alone, its weights averaged every `sync_every` steps.

Local SGD (Stich 2019; Lin et al. 2020; Accelerate's LocalSGD, torch's PeriodicModelAverager): where a step's
gradient exchange is the slow part, the replicas meet H times less often. The meeting (periodic.py) averages
the replicas' weights, weighted by the rows each trained on; with sync_every=1, plain SGD and uneven shares it is
exactly the single device's step. For H > 1 the result differs from one device: each replica follows its own
rows between meetings (docs/strategies.md says by how much on the examples). Each optimizer's state stays its
replica's own.
"""

from __future__ import annotations

import torch

from dpkit.strategies.base import ON_ROOT, PER_DEVICE, PERSISTENT, Traits
from dpkit.strategies.periodic import DEFAULT_SYNC_EVERY, PeriodicStrategy


class LocalSGD(PeriodicStrategy):
    name = "localsgd"
    traits = Traits(processes=PER_DEVICE, loss=ON_ROOT, replicas=PERSISTENT, sync_every=DEFAULT_SYNC_EVERY)

    def meet(self, mean_move: list[torch.Tensor]) -> list[torch.Tensor]:
        return [a.float() + m for a, m in zip(self.anchor, mean_move)]  # the replicas' average

    def layout(self) -> str:
        return f"{self.name} every {self.sync_every} steps"
