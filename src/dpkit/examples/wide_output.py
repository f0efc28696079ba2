"""A classifier whose output is wide relative to the rest: a small trunk and a 20,000-class head.

This is where DataParallel's device-0 imbalance is real: the primary device receives every replica's
logits (batch x classes), computes the whole loss and its gradient there, and alone holds the reduced
gradients and the optimizer state. Data is synthetic, made locally from a seed and cheap to make: a
sample's label is a grid cell of two random projections of its features, so the task is learnable.
"""

from __future__ import annotations

import torch
from torch import nn

FEATURES = 64
CLASSES = 20_000

# `dpkit profile`'s default batch for this example, per device (256 rows on 4 devices). Under dp-balanced the
# first device holds ~15 MiB whatever its rows (the weights, their summed gradients, Adam's two moments) while a
# row costs another device ~0.23 MiB, so the peaks even out only from ~45 rows per device: at a fixed global
# batch of 64 (16 per device) that share is the largest peak whatever the split.
PROFILE_ROWS_PER_DEVICE = 64


class WideOutputNet(nn.Module):
    """features -> hidden -> hidden -> classes; no BatchNorm or dropout, so every strategy agrees."""

    def __init__(self, features: int = FEATURES, hidden: int = 32, classes: int = CLASSES):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def make_wide_output_data(
    seed: int = 0, n_train: int = 4096, n_test: int = 512, features: int = FEATURES, classes: int = CLASSES
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): Gaussian features; the label is the cell of a rows x cols grid
    (rows * cols <= classes) that two random projections fall into, cut at the normal's quantiles."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_test, features, generator=generator)
    directions = torch.randn(features, 2, generator=generator)
    projected = (x @ directions) / directions.norm(dim=0)  # each column ~ N(0, 1)
    rows = max(1, int(classes**0.5))
    cols = classes // rows
    normal = torch.distributions.Normal(0.0, 1.0)
    cells = normal.cdf(projected)  # uniform in [0, 1): equal-probability cells
    y = (cells[:, 0] * rows).long().clamp(max=rows - 1) * cols + (cells[:, 1] * cols).long().clamp(max=cols - 1)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]
