"""Model factories of two widths for the plan and bench tests and benchmarks/calibration_accuracy.py (imported
by name, as `--model widths:narrow`)."""

from torch import nn


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def narrow() -> nn.Module:
    return mlp(512)


def wide() -> nn.Module:
    return mlp(1024)
