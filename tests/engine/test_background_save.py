"""Saves that do not stop training (issue 48): engine.save_state(blocking=False) copies the state now and writes it
in the background, all or nothing; a resume from it equals the uninterrupted run bit for bit (the one-process
strategies, ddp, fsdp and zero, whose writing thread's agreement and shards stay off the training's collectives);
while it is being written the newest whole state is still the one a load finds, and a process killed inside the
write leaves it to resume from; a failed write is raised in the loop at the next save or at close, with its path and
cause."""

from __future__ import annotations

import errno
import subprocess
import sys
import threading
from pathlib import Path

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
    # (a sharded strategy's weights are DTensors: whole ones, gathered by every process alike)
    weights = {k: getattr(v, "full_tensor", v.detach)().detach().clone() for k, v in model.state_dict().items()}
    engine.close()  # (waits for the save in flight)
    return weights, isinstance(handle, SaveHandle)


@pytest.mark.parametrize("strategy,devices", [("single", 1), ("dp", 2), ("dp-balanced", 2), ("replicated", 2)])
def test_a_background_save_resumes_bit_for_bit(tmp_path, strategy, devices):
    whole, background = train(strategy, devices, str(tmp_path / "a"), save_at=2)
    assert background
    resumed, _ = train(strategy, devices, str(tmp_path / "a"), resume=True)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


# held in its files; placed (renamed into place), before `latest` moves
@pytest.mark.parametrize("point,placed", [("write_checked", False), ("atomic_write", True)])
def test_while_it_is_written_the_newest_whole_state_is_what_a_load_finds(tmp_path, monkeypatch, point, placed):
    engine = Engine(accelerator="cpu", devices=1, progress=False)
    net = nn.Linear(4, 2)
    model, optimizer = engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    folder = tmp_path / "state"
    first = engine.save_state(folder)
    writing, release = threading.Event(), threading.Event()
    real = getattr(writes, point)

    def held(*args, **kwargs):  # the background write stops at `point`, driven from here
        writing.set()
        release.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(writes, point, held)
    engine.backward(model(torch.randn(3, 4)).sum())
    optimizer.step()
    handle = engine.save_state(folder, blocking=False)
    try:
        assert writing.wait(timeout=60)
        assert not handle.done()
        assert (folder / "latest").read_text().split()[0] == first.name  # `latest` has not moved
        steps = sorted(p.name for p in folder.iterdir() if p.name.startswith("step-"))
        assert steps == ([first.name, "step-00000001"] if placed else [first.name])
        reader = Engine(accelerator="cpu", devices=1, progress=False)  # what a kill now would leave to resume from
        layer = nn.Linear(4, 2)
        reader.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
        reader.load_state(folder)
        assert reader.step == 0
        reader.close()
    finally:
        release.set()  # (a failed check must not leave the write held: the process's exit waits for it)
    assert handle.wait().name == "step-00000001" and (folder / "latest").read_text().startswith("step-00000001")
    engine.close()


@pytest.mark.parametrize("where", ["next save", "close"])
def test_a_failed_background_write_is_raised_in_the_loop_with_its_path(tmp_path, monkeypatch, where):
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
        # the next save says it, in the loop, before it stages its own; close says it after releasing the rest
        engine.save_state(folder) if where == "next save" else engine.close()
    assert str(failed.value) == (
        f"no space left on device while writing {folder / 'step-00000001' / 'rank-0.pt'}; the previous state is intact"
    )
    assert (folder / "latest").read_text().split()[0] == first.name  # the previous state intact
    assert sorted(path.name for path in folder.iterdir()) == ["latest", first.name]
    engine.close()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero"])
def test_per_device_the_background_write_keeps_out_of_the_training_collectives(tmp_path, groups, strategy):
    # ddp's whole state from rank 0; fsdp's and zero's shards written by every process through DCP, on the save's
    # own group while the training's collectives go on
    folder = str(tmp_path / strategy)
    whole = groups(2).run(train, strategy, 2, folder, save_at=2)
    resumed = groups(2).run(train, strategy, 2, folder, resume=True)
    for rank in range(2):
        assert whole[rank][1]
        assert all(torch.equal(whole[rank][0][k], resumed[rank][0][k]) for k in whole[rank][0])


HELD_SAVE = Path(__file__).with_name("held_save.py")


def test_a_kill_during_the_background_write_leaves_the_newest_whole_state_to_resume(tmp_path):
    # the process killed with its write held inside its files (the test above holds it at the commit too)
    folder, weights = tmp_path / "state", tmp_path / "step-1.pt"
    child = subprocess.Popen(
        [sys.executable, str(HELD_SAVE), str(folder), str(weights), "write_checked"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline() == "held\n"  # the step-2 write is held inside its files now
    finally:
        child.kill()
        child.communicate()
    assert (folder / "latest").read_text().split()[0] == "step-00000001"
    engine = Engine(accelerator="cpu", devices=1, progress=False)
    net = nn.Linear(4, 2)
    model, optimizer = engine.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    engine.load_state(folder)
    assert engine.step == 1
    saved = torch.load(weights, weights_only=True)
    assert all(torch.equal(saved[key], value) for key, value in model.state_dict().items())
    engine.backward(model(torch.ones(3, 4)).sum())
    optimizer.step()
    assert engine.save_state(folder).name == "step-00000002"  # over what the killed write left
    assert sorted(path.name for path in folder.iterdir()) == ["latest", "step-00000001", "step-00000002"]
    engine.close()


def test_a_worker_leaving_without_atexit_writes_its_save_in_flight_first(tmp_path):
    # a launched worker leaves through exit_worker, which skips the atexit handlers: the save is written first
    folder = tmp_path / "state"
    child = subprocess.run(
        [sys.executable, str(HELD_SAVE), str(folder), str(tmp_path / "step-1.pt"), "exit_worker"], timeout=300
    )
    assert child.returncode == 0
    assert (folder / "latest").read_text().split()[0] == "step-00000002"
    engine = Engine(accelerator="cpu", devices=1, progress=False)
    net = nn.Linear(4, 2)
    engine.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    engine.load_state(folder)
    assert engine.step == 2
    engine.close()
