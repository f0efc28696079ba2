"""A whole state (saved by one process) resumes under fsdp, zero stage 2 and hsdp, with an optimizer that keeps no
per-parameter tensors (plain SGD) and with one whose scheduler is made after the load (as `dpkit train` makes its
schedule): torch's distributing load asserted "Expected device to be set" on the first and missed `initial_lr` in
the second (issue 43). The resumed run ends where the uninterrupted one does."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpkit.engine.engine import Engine

STEPS, SAVED_AT = 6, 3
TOLERANCE = 1e-5  # relative to the largest weight: one process and two sum the rows in different orders


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(4)
    return TensorDataset(torch.randn(96, 10, generator=generator), torch.randint(0, 3, (96,), generator=generator))


def run(strategy: str, devices: int, optimizer: str, folder: str, until: int, options: dict | None = None) -> dict:
    """Train to step `until` (resuming from `folder` when it holds a state, saving there at SAVED_AT); the weights."""
    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False, **(options or {}))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
    if optimizer == "sgd":
        made = torch.optim.SGD(model.parameters(), lr=0.2)
    else:
        made = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, engine_optimizer = engine.setup(model, made)
    loader = engine.setup_dataloader(DataLoader(data(), batch_size=16))
    if (Path(folder) / "latest").exists():
        engine.load_state(folder)
    # made after the load, as the recipe makes its schedule: the saved groups hold its initial_lr, these do not yet
    schedule = torch.optim.lr_scheduler.LambdaLR(engine_optimizer, lambda step: 1.0 / (1 + step))
    for _ in range(engine.step):
        schedule.step()
    while engine.step < until:
        for x, y in loader:
            engine_optimizer.zero_grad()
            engine.backward(nn.functional.cross_entropy(model(x), y))
            engine_optimizer.step()
            schedule.step()
            if engine.step == SAVED_AT and not (Path(folder) / "latest").exists():
                engine.save_state(folder)
            if engine.step == until:
                break
    weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in model.state_dict().items()}
    engine.close()
    return weights


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_whole_state_resumes_under_every_sharded_strategy(optimizer, tmp_path, groups):
    whole = run("single", 1, optimizer, str(tmp_path / "uninterrupted"), STEPS)
    saved = tmp_path / "saved"
    run("single", 1, optimizer, str(saved), SAVED_AT)
    scale = max(t.abs().max().item() for t in whole.values())
    for strategy, options in (("fsdp", {}), ("zero", {"stage": 2}), ("hsdp", {})):
        folder = tmp_path / f"{strategy}-{optimizer}"
        shutil.copytree(saved, folder, symlinks=True)  # each resume writes on in its own copy
        for rank, weights in enumerate(groups(2).run(run, strategy, 2, optimizer, str(folder), STEPS, options)):
            difference = max((weights[k] - whole[k]).abs().max().item() for k in whole) / scale
            assert difference <= TOLERANCE, f"{strategy} {options} {optimizer}, process {rank}: {difference:.3g}"
