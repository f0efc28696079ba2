"""A model whose weights dominate a step's memory: a stack of wide residual blocks, small input and output.

Four blocks of two 960 x 960 linear layers hold 7.4 million parameters (30 MB in float32); with their
gradients and Adam's two moments a step keeps about 118 MB of training state, while a batch of 128 rows
keeps a few MB of activations. This is the model sharding is for: under ddp every device holds all of
that state, under fsdp each holds 1/N of it plus the block or two it has gathered. The blocks sit in an
nn.ModuleList, so fsdp's default rule makes each block a unit of its own (a layer is 922,560 parameters,
under the rule's 1,000,000 that would make each layer a unit by itself).

Data is synthetic, made locally from a seed and cheap to make: Gaussian features, and the label is the
class a fixed random two-layer "teacher" scores highest, so the task is learnable.
"""

from __future__ import annotations

import torch
from torch import nn

FEATURES = 64
WIDTH = 960
BLOCKS = 4
CLASSES = 10


class WideBlock(nn.Module):
    """x + W2 relu(W1 layernorm(x)): a pre-norm residual block of two wide linear layers."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.expand = nn.Linear(width, width)
        self.project = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(torch.relu(self.expand(self.norm(x))))


class WideBlocksNet(nn.Module):
    """features -> width -> `blocks` residual blocks -> classes. LayerNorm is per sample (no batch
    statistics) and there is no dropout, so every strategy computes the same model."""

    def __init__(self, features: int = FEATURES, width: int = WIDTH, blocks: int = BLOCKS, classes: int = CLASSES):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(WideBlock(width) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_wide_blocks_data(
    seed: int = 0,
    n_train: int = 4096,
    n_test: int = 512,
    features: int = FEATURES,
    classes: int = CLASSES,
    hidden: int = 32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): Gaussian features; the label is the argmax of a random
    features -> hidden -> classes ReLU network drawn from the same seed."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_test, features, generator=generator)
    first = torch.randn(features, hidden, generator=generator) / features**0.5
    second = torch.randn(hidden, classes, generator=generator) / hidden**0.5
    y = (torch.relu(x @ first) @ second).argmax(dim=1)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]
