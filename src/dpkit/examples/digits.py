"""scikit-learn's bundled digits (no download) and a small MLP with no batch-dependent layers."""

from __future__ import annotations

import torch
from torch import nn


def load_digits(
    seed: int = 0, test_fraction: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): 8x8 images flattened to 64 features in [0, 1], stratified split."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    data = sklearn_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        list(range(len(y))), test_size=test_fraction, random_state=seed, stratify=data.target
    )
    train_idx, test_idx = torch.tensor(train_idx), torch.tensor(test_idx)
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


class DigitsMLP(nn.Module):
    """64 -> hidden -> hidden -> 10; no BatchNorm or dropout, so every strategy computes the same model."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
