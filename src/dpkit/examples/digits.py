"""scikit-learn's bundled digits (no download) and a small MLP with no batch-dependent layers."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn


def load_digits(
    seed: int = 0, test_fraction: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): 8x8 images flattened to 64 features in [0, 1], split stratified by
    class (each class's share of the test rows is its share of the data), the same for a seed on every machine."""
    features, labels = _bundled_digits()
    x = torch.tensor(features / 16.0, dtype=torch.float32)
    y = torch.tensor(labels, dtype=torch.int64)
    train_idx, test_idx = _stratified_split(y, test_fraction, seed)
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


def _bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits.csv.gz (64 pixel values 0-16 and the digit, per row), read from the installed
    package without importing it: importing scikit-learn costs every process that trains on digits most of a
    second of imports (scipy), a launched worker included. Its own loader if the file is not where it was."""
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    return data.data, data.target


def _stratified_split(labels: torch.Tensor, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the training and test rows: ceil(test_fraction * rows) test rows, shared among the classes in
    proportion to their sizes (the rows left by rounding down go to the largest remainders), each class's test
    rows drawn at random; both lists shuffled."""
    generator = torch.Generator().manual_seed(seed)
    classes, counts = torch.unique(labels, return_counts=True)
    wanted = [test_fraction * int(n) for n in counts]
    taken = [math.floor(w) for w in wanted]
    left = math.ceil(test_fraction * len(labels)) - sum(taken)
    for k in sorted(range(len(classes)), key=lambda k: (taken[k] - wanted[k], k))[:left]:
        taken[k] += 1
    train, test = [], []
    for label, n_test in zip(classes, taken):
        rows = torch.nonzero(labels == label).flatten()
        rows = rows[torch.randperm(len(rows), generator=generator)]
        test.append(rows[:n_test])
        train.append(rows[n_test:])
    train_idx, test_idx = torch.cat(train), torch.cat(test)
    return (
        train_idx[torch.randperm(len(train_idx), generator=generator)],
        test_idx[torch.randperm(len(test_idx), generator=generator)],
    )


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
