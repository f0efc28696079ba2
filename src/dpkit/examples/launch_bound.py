"""Models whose step is launch-bound: many small layers on small inputs, where a step's time goes to
launching operations (Python, dispatch, autograd bookkeeping) rather than to arithmetic.

This is where DataParallel's per-step work (scatter, re-making the replicas, gather, one Python thread per
device under the GIL) weighs most against the step itself, and where one device is the fast choice on CPU.

- `launch-bound`: an MLP of 40 residual `Linear(32, 32)` + ReLU layers between a 32-wide input layer and
  a 10-class head (43,626 parameters, 85 modules); a global batch of 32 rows takes a few milliseconds on
  one core, almost none of it arithmetic.
- `launch-bound-conv`: a small convolutional net, 12 `Conv2d(8, 8, 3)` + ReLU layers on scikit-learn's
  bundled 8x8 digits (no download); `dpkit train --example launch-bound-conv --lr 0.01 --momentum 0.9
  --batch-size 32 --steps 600` reaches about 84% test accuracy.

The MLP's data is synthetic, made locally from a seed and cheap to make: Gaussian features, and the label
is the class of the random direction they point to most, so the task is learnable.
"""

from __future__ import annotations

import torch
from torch import nn

from dpkit.examples.digits import load_digits

FEATURES = 32
WIDTH = 32
DEPTH = 40
CLASSES = 10
CONV_CHANNELS = 8
CONV_DEPTH = 12


class LaunchBoundMLP(nn.Module):
    """features -> `depth` residual layers x + relu(Linear(width, width)(x)) -> Linear(width, classes).

    The layers and their ReLUs are modules of their own (two ModuleLists), so a replica copies every one.
    The residual form and small initial weights (He's variance divided by the depth) let 40 layers train;
    no batch statistics and no dropout, so every strategy computes the same model."""

    def __init__(
        self, features: int = FEATURES, width: int = WIDTH, depth: int = DEPTH, classes: int = CLASSES
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        linears = [nn.Linear(width, width) for _ in range(depth)]
        self.linears = nn.ModuleList(linears)
        self.activations = nn.ModuleList(nn.ReLU() for _ in range(depth))
        self.head = nn.Linear(width, classes)
        for linear in linears:
            nn.init.normal_(linear.weight, std=(2.0 / width / depth) ** 0.5)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for linear, activation in zip(self.linears, self.activations):
            x = x + activation(linear(x))
        return self.head(x)


def make_launch_bound_data(
    seed: int = 0,
    n_train: int = 4096,
    n_test: int = 512,
    features: int = FEATURES,
    classes: int = CLASSES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): Gaussian features; the label is the class whose random direction
    (drawn from the same seed) the features point to most, so the classes are about equally frequent."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_test, features, generator=generator)
    directions = torch.randn(features, classes, generator=generator)
    y = (x @ directions).argmax(dim=1)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


class LaunchBoundConvNet(nn.Module):
    """1x8x8 images -> Conv2d(1, channels, 3) + ReLU -> `depth - 1` x (Conv2d(channels, channels, 3) + ReLU)
    -> global average pool -> Linear(channels, classes). Padding keeps every map 8x8; no batch statistics
    and no dropout, so every strategy computes the same model."""

    def __init__(self, channels: int = CONV_CHANNELS, depth: int = CONV_DEPTH, classes: int = CLASSES) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for k in range(depth):
            layers += [nn.Conv2d(1 if k == 0 else channels, channels, 3, padding=1), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)
        for layer in self.features:
            if isinstance(layer, nn.Conv2d):  # He's initialisation: 12 ReLU layers keep their signal
                nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                if layer.bias is not None:  # (made with one)
                    nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def load_digit_images(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bundled digits as 1x8x8 images: (x_train, y_train, x_test, y_test), split as load_digits does."""
    x_train, y_train, x_test, y_test = load_digits(seed)
    return x_train.view(-1, 1, 8, 8), y_train, x_test.view(-1, 1, 8, 8), y_test
