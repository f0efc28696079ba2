"""A recipe run's evaluations: loss and accuracy on the test data over every device and process, and the
best model kept by one of them (OUT/best.pt, described by OUT/best.json).

Every process takes part in an evaluation (it gathers), and every process sees the same figures, so they all
agree on whether the model is the best so far and save it together (a sharded model is gathered to rank 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

if TYPE_CHECKING:
    from dpkit.engine.engine import Engine

EVAL_BATCH = 256


@dataclass
class Scores:
    loss: float
    accuracy: float
    samples: int


def evaluate(
    engine: Engine, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, stop: Callable[[], bool]
) -> Scores | None:
    """Mean cross-entropy and accuracy of `model` on (x, y), in eval mode, back in train mode after. `stop()` is
    asked after every batch (every process at the same batch); a True ends the evaluation with None scores."""
    model.eval()
    loader = engine.setup_dataloader(DataLoader(TensorDataset(x, y), batch_size=EVAL_BATCH))
    # this process's sums and count, reduced once at the end: every sample counted once, by the process that
    # loaded it (a share of each global batch; a per-process stream's rank that ran out sits out with zero rows)
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, samples
    try:
        with torch.no_grad():
            for inputs, targets in loader:
                output = model(inputs).float()
                totals[0] += F.cross_entropy(output, targets, reduction="sum").double().cpu()
                totals[1] += (output.argmax(dim=1) == targets).sum().double().cpu()
                totals[2] += len(targets)
                if stop():
                    return None
    finally:
        model.train()
    loss_sum, correct, samples = engine.reduce(totals, "sum").tolist()
    return Scores(loss_sum / samples, correct / samples, int(samples))


class Best:
    """The best evaluation so far by `metric` ("accuracy", larger is better; "loss", smaller is better)."""

    def __init__(self, metric: str, larger_is_better: bool, saved: dict[str, Any] | None = None):
        self.metric = metric
        self.larger_is_better = larger_is_better
        self.step: int | None = None
        self.value: float | None = None
        if saved and saved.get("metric") == metric:
            self.step, self.value = saved.get("step"), saved.get("value")

    def improves(self, scores: Scores) -> bool:
        value = getattr(scores, self.metric)
        if not math.isfinite(value):
            return False
        if self.value is None:
            return True
        return value > self.value if self.larger_is_better else value < self.value

    def take(self, step: int, scores: Scores) -> None:
        self.step, self.value = step, getattr(scores, self.metric)

    def record(self) -> dict[str, Any]:
        return {"metric": self.metric, "step": self.step, "value": self.value}
