"""A run stopped and resumed from engine.save_state ends bitwise where the uninterrupted run ends.

Each run trains a small dropout MLP with momentum SGD on a shuffled loader (the order drawn from torch's
global generator, so the generator state matters) for STEPS optimizer steps, 6 batches per epoch, the
last one short. The interrupted runs stop at a step inside an epoch, at an epoch's end and in a later
epoch, save, and a fresh Engine in a fresh model resumes from the saved directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import dpkit
from dpkit.checkpoint import clean_state_dict

STEPS = 14
FEATURES, CLASSES, SAMPLES, BATCH = 8, 3, 45, 8  # 6 batches per epoch, the last of 5 rows


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def build_model(dropout: float) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, CLASSES))


def loader_for(seeded_order: bool) -> DataLoader:
    data = dataset()
    if seeded_order:  # the same global batches for every strategy and world size
        return DataLoader(data, batch_size=BATCH, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(5)))
    return DataLoader(data, batch_size=BATCH, shuffle=True)


def run(strategy: str, devices: int, state_dir: Path, *, stop_at: int | None = None, resume: bool = False,
        seeded_order: bool = False, dropout: float = 0.3, steps: int = STEPS) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """Train up to `steps` (or save and stop at `stop_at`); the weights and the loss of every step run here."""
    engine = dpkit.Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False)
    torch.manual_seed(0)
    model = build_model(dropout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 4, 0.5)  # an extra object with state
    model, optimizer = engine.setup(model, optimizer)
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    loader = engine.setup_dataloader(loader_for(seeded_order))
    losses: dict[int, float] = {}
    if resume:
        extras = engine.load_state(state_dir, scheduler=scheduler)
        assert extras["note"] == f"stopped at {engine.step}"
    while engine.step < steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            engine.backward(loss)
            optimizer.step()
            scheduler.step()
            losses[engine.step] = loss.item()
            if engine.step == stop_at:
                engine.save_state(state_dir, keep=2, scheduler=scheduler, note=f"stopped at {engine.step}")
                engine.close()
                return clean_state_dict(model), losses
            if engine.step == steps:
                break
    engine.close()
    return {k: v.clone() for k, v in clean_state_dict(model).items()}, losses


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs by {(a[key] - b[key]).abs().max().item():.3g}"


@pytest.mark.parametrize("strategy,devices", [("single", 1), ("dp", 2), ("dp-balanced", 2), ("replicated", 2)])
def test_resume_equals_uninterrupted_bitwise(tmp_path, strategy, devices):
    reference, reference_losses = run(strategy, devices, tmp_path / "unused")
    assert len(reference_losses) == STEPS
    for stop_at in (3, 6, 10):  # mid-epoch, the end of the first epoch, inside the second
        state_dir = tmp_path / f"stop-{stop_at}"
        _, first_losses = run(strategy, devices, state_dir, stop_at=stop_at)
        weights, resumed_losses = run(strategy, devices, state_dir, resume=True)
        assert_bitwise(reference, weights, f"{strategy} stopped at {stop_at}")
        assert {**first_losses, **resumed_losses} == reference_losses
        assert min(resumed_losses) == stop_at + 1


def test_resume_twice_and_keep(tmp_path):
    reference, _ = run("single", 1, tmp_path / "unused")
    state_dir = tmp_path / "state"
    run("single", 1, state_dir, stop_at=4)
    engine_free_steps = []
    for stop_at in (7, 9, 12):
        run("single", 1, state_dir, stop_at=stop_at, resume=True)
        engine_free_steps.append(stop_at)
    assert sorted(p.name for p in state_dir.iterdir()) == ["latest", "step-00000009", "step-00000012"]  # keep=2
    weights, _ = run("single", 1, state_dir, resume=True)
    assert_bitwise(reference, weights, "resumed four times")


@pytest.mark.parametrize("first,second", [(("single", 1), ("dp", 3)), (("dp", 3), ("replicated", 2)),
                                          (("replicated", 2), ("single", 1)), (("dp-balanced", 2), ("dp", 3))])
def test_resume_under_another_strategy_and_world_size(tmp_path, first, second):
    """The same global batches (a seeded sampler) and no dropout: a run saved under one strategy and world size
    and resumed under another ends where a single-device run ends, up to float32 rounding: splitting a batch
    over another number of replicas changes the order of the gradient sums, so bits may differ (dropout would
    also differ: its masks are drawn per replica)."""
    reference, reference_losses = run("single", 1, tmp_path / "unused", seeded_order=True, dropout=0.0)
    state_dir = tmp_path / "state"
    _, first_losses = run(*first, state_dir, stop_at=5, seeded_order=True, dropout=0.0)
    weights, losses = run(*second, state_dir, resume=True, seeded_order=True, dropout=0.0)
    assert sorted(losses) == list(range(6, STEPS + 1))
    for key in reference:
        torch.testing.assert_close(weights[key], reference[key], rtol=1e-5, atol=1e-6)
    for step, loss in {**first_losses, **losses}.items():
        assert loss == pytest.approx(reference_losses[step], rel=1e-5, abs=1e-6)
