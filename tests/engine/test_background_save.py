"""Saves that do not stop training (issue 48): engine.save_state(blocking=False) copies the state now and writes it
in the background, all or nothing; a resume from it equals the uninterrupted run bit for bit; while it is being
written the newest whole state is still the one a load finds; a failed write is raised in the loop at the next save
(or close) with its path and cause; under ddp the writing thread's agreement stays off the training's collectives."""

from __future__ import annotations

import errno
import threading

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpkit.checkpoint.writes as writes
from dpkit.checkpoint.errors import CheckpointWriteError
from dpkit.engine.background_save import SaveHandle
from dpkit.engine.engine import Engine

STEPS = 6


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(96, 8, generator=generator), torch.randint(0, 3, (96,), generator=generator))


def train(strategy: str, devices: int, folder: str, steps: int = STEPS, save_at: int | None = None, resume=False):
    """Train to `steps` (resumed from `folder`, or saving there in the background at `save_at`); the weights."""
    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    model, optimizer = engine.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))
    loader = engine.setup_dataloader(DataLoader(data(), batch_size=16, shuffle=True))
    if resume:
        engine.load_state(folder)
    handle = None
    while engine.step < steps:
        for x, y in loader:
            optimizer.zero_grad()
            engine.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            if engine.step == save_at:
                handle = engine.save_state(folder, blocking=False)  # the loop goes on while it is written
            if engine.step == steps:
                break
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.close()  # (waits for the save in flight)
    return weights, isinstance(handle, SaveHandle)


def test_a_background_save_resumes_bit_for_bit(tmp_path):
    whole, background = train("single", 1, str(tmp_path / "a"), save_at=2)
    assert background
    resumed, _ = train("single", 1, str(tmp_path / "a"), resume=True)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_while_it_is_written_the_newest_whole_state_is_what_a_load_finds(tmp_path, monkeypatch):
    engine = Engine(accelerator="cpu", devices=1, progress=False)
    net = nn.Linear(4, 2)
    model, optimizer = engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    folder = tmp_path / "state"
    first = engine.save_state(folder)
    writing, release = threading.Event(), threading.Event()
    real = writes.write_checked

    def held(content, handle):  # the background write stops inside its files, driven from here
        writing.set()
        release.wait()
        real(content, handle)

    monkeypatch.setattr(writes, "write_checked", held)
    engine.backward(model(torch.randn(3, 4)).sum())
    optimizer.step()
    handle = engine.save_state(folder, blocking=False)
    assert writing.wait(timeout=60)
    assert not handle.done()
    assert (folder / "latest").read_text().split()[0] == first.name  # `latest` has not moved
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step-")) == [first.name]
    release.set()
    assert handle.wait().name == "step-00000001" and (folder / "latest").read_text().startswith("step-00000001")
    engine.close()


def test_a_failed_background_write_is_raised_at_the_next_save_with_its_path(tmp_path, monkeypatch):
    engine = Engine(accelerator="cpu", devices=1, progress=False)
    net = nn.Linear(4, 2)
    model, optimizer = engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    folder = tmp_path / "state"
    first = engine.save_state(folder)

    def full(content, handle):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writes, "write_checked", full)
    engine.backward(model(torch.randn(3, 4)).sum())
    optimizer.step()
    engine.save_state(folder, blocking=False)
    with pytest.raises(CheckpointWriteError) as failed:
        engine.save_state(folder)  # the next save says it, in the loop, before it stages its own
    assert str(failed.value) == (
        f"no space left on device while writing {folder / 'step-00000001' / 'rank-0.pt'}; the previous state is intact"
    )
    assert (folder / "latest").read_text().split()[0] == first.name  # the previous state intact
    engine.close()


def test_under_ddp_the_background_write_keeps_out_of_the_training_collectives(tmp_path, groups):
    folder = str(tmp_path / "ddp")
    whole = groups(2).run(train, "ddp", 2, folder, save_at=2)
    resumed = groups(2).run(train, "ddp", 2, folder, resume=True)
    for rank in range(2):
        assert whole[rank][1]
        assert all(torch.equal(whole[rank][0][k], resumed[rank][0][k]) for k in whole[rank][0])
