"""Helpers shared by the strategy tests: `dpkit train` runs, cached per (strategy, devices, batch)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dpkit.cli.main import main
from dpkit.strategies import PER_DEVICE, strategy_class

STEPS = 20
LR = 0.1
SEED = 3


def train_args(strategy: str, devices: int, batch_size: int, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--example",
        "digits",
        "--strategy",
        strategy,
        "--accelerator",
        "cpu",
        "--devices",
        str(devices),
        "--steps",
        str(STEPS),
        "--batch-size",
        str(batch_size),
        "--seed",
        str(SEED),
        "--lr",
        str(LR),
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


def train_here(argv: list[str]) -> int:
    """`dpkit train ARGV` in this process: under a launcher, as this process's rank of the run."""
    return main(argv)


class Runs:
    """Runs cached by their arguments. A strategy with a process per device runs in a launched group of the
    session (`groups`) as under `dpkit launch`; `dpkit train` starting its own processes is tested in
    tests/cli/test_train.py."""

    def __init__(self, root: Path, groups):
        self.root = root
        self.groups = groups
        self.done: dict[tuple, Path] = {}

    def __call__(self, strategy: str, devices: int, batch_size: int, *extra: str) -> Path:
        key = (strategy, devices, batch_size, *extra)
        if key not in self.done:
            out = self.root / "-".join(map(str, key)).replace("--", "")
            self.done[key] = self.run_into(out, strategy, devices, batch_size, *extra)
        return self.done[key]

    def run_into(self, out: Path, strategy: str, devices: int, batch_size: int, *extra: str) -> Path:
        """The run, not cached, into `out`."""
        argv = train_args(strategy, devices, batch_size, out, *extra)
        if strategy_class(strategy).traits.processes == PER_DEVICE:
            assert self.groups(devices).run(train_here, argv) == [0] * devices
        else:
            assert train_here(argv) == 0
        return out


def load_state(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "model.pt", weights_only=True)


def load_metrics(folder: Path) -> dict:
    return json.loads((folder / "metrics.json").read_text())


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b), f"different keys: {list(a)} vs {list(b)}"
    return max((a[k] - b[k]).abs().max().item() for k in a)
