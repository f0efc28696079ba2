"""The pieces of a resumable state: generators, loader positions, the state directory, load's checks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import dpkit
from dpkit.checkpoint.generators import capture_rng, restore_rng
from dpkit.checkpoint.model_files import CheckpointCorruptError, CheckpointMismatchError
from dpkit.engine.resumable_loader import ResumableLoader
from dpkit.engine.wrappers import Accumulation


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_generators_come_back_exactly():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    saved = capture_rng()
    expected = draws()
    draws()
    restore_rng(saved)
    assert draws() == expected


@pytest.mark.parametrize("order", ["global", "seeded"])
def test_a_loader_resumes_mid_epoch_with_the_same_order_and_generators(order):
    data = TensorDataset(torch.arange(23))

    def make() -> ResumableLoader:
        if order == "global":
            return ResumableLoader(DataLoader(data, batch_size=4, shuffle=True))
        return ResumableLoader(
            DataLoader(data, batch_size=4, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(4)))
        )

    torch.manual_seed(0)
    loader = make()
    epoch0 = [ids.tolist() for (ids,) in loader]
    iterator = iter(loader)
    first_two = [next(iterator)[0].tolist() for _ in range(2)]
    position, order_state, rng = loader.position(), loader.order_state(), capture_rng()
    rest = [ids.tolist() for (ids,) in iterator]
    after = torch.rand(2)
    assert position == {"epoch": 1, "next_batch": 2, "batches_per_epoch": 6, "dataset_size": 23}

    torch.manual_seed(99)  # a new process: other generator states
    resumed = make()
    resumed.resume_from(position, order_state)
    restore_rng(rng)
    assert [ids.tolist() for (ids,) in resumed] == rest
    assert torch.equal(torch.rand(2), after)  # redrawing the order left the global generator where it was
    assert resumed.last_batch.epoch == 1 and resumed.last_batch.index == 5
    assert sorted(i for b in first_two + rest for i in b) == list(range(23)) and epoch0 != first_two + rest


def test_a_loop_that_breaks_starts_a_new_epoch_but_a_resumed_loader_continues():
    loader = ResumableLoader(DataLoader(TensorDataset(torch.arange(12)), batch_size=4))
    for _ in loader:
        break
    assert loader.position()["next_batch"] == 1
    assert [ids.tolist() for (ids,) in loader][0] == [0, 1, 2, 3]  # epoch 1 from its start, as a DataLoader does
    assert loader.position() == {"epoch": 2, "next_batch": 0, "batches_per_epoch": 3, "dataset_size": 12}


def make_engine(strategy="single", devices=1, *, batch_size=4, accumulate=1, dataloader=True):
    engine = dpkit.Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False, accumulate=accumulate)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Dropout(0.2), nn.Linear(5, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = engine.setup(model, optimizer)
    loader = None
    if dataloader:
        x = torch.randn(20, 3, generator=torch.Generator().manual_seed(1))
        loader = engine.setup_dataloader(
            DataLoader(TensorDataset(x, x.sum(1, keepdim=True).repeat(1, 2)), batch_size=batch_size, shuffle=True)
        )
    return engine, model, optimizer, loader


def train_steps(engine, model, optimizer, loader, steps):
    while engine.step < steps:
        for x, y in loader:
            optimizer.zero_grad()
            engine.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            if engine.step == steps:
                return


def test_accumulation_resumes_exactly_and_refuses_a_save_mid_window(tmp_path):
    engine, model, optimizer, loader = make_engine(accumulate=2, batch_size=3)
    train_steps(engine, model, optimizer, loader, 3)
    engine.save_state(tmp_path)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    engine.backward(nn.functional.mse_loss(model(x), y))  # one micro-batch of two
    with pytest.raises(RuntimeError, match="micro-batch 1 of 2.*after optimizer.step"):
        engine.save_state(tmp_path)
    reference = make_engine(accumulate=2, batch_size=3)
    train_steps(*reference, 8)
    resumed = make_engine(accumulate=2, batch_size=3)
    resumed[0].load_state(tmp_path)
    assert resumed[0].step == 3
    train_steps(*resumed, 8)
    for a, b in zip(reference[1].parameters(), resumed[1].parameters()):
        assert torch.equal(a, b)


def test_two_optimizers_both_step_and_the_step_counts_once():
    accumulation = Accumulation(every=1)
    model = nn.Linear(2, 2)
    from dpkit.engine.wrappers import EngineOptimizer
    from dpkit.precision import Precision

    first = EngineOptimizer(torch.optim.SGD([model.weight], lr=1.0), accumulation, Precision())
    second = EngineOptimizer(torch.optim.SGD([model.bias], lr=1.0), accumulation, Precision())
    before = (model.weight.detach().clone(), model.bias.detach().clone())
    assert accumulation.add_micro_batch() is True
    model(torch.ones(1, 2)).sum().backward()
    first.step()
    second.step()
    assert not torch.equal(model.weight, before[0]) and not torch.equal(model.bias, before[1])
    assert accumulation.steps == 1


def test_load_checks_everything_before_changing_anything(tmp_path):
    engine, model, optimizer, loader = make_engine()
    train_steps(engine, model, optimizer, loader, 2)
    engine.save_state(tmp_path)
    other = dpkit.Engine(strategy="single", accelerator="cpu", devices=1, progress=False)
    wide = nn.Sequential(nn.Linear(3, 6), nn.Dropout(0.2), nn.Linear(6, 2))
    wide_optimizer = torch.optim.Adam(wide.parameters(), lr=0.01)
    other.setup(wide, wide_optimizer)
    before = [p.detach().clone() for p in wide.parameters()]
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointMismatchError, match=r"0.weight: checkpoint \(5, 3\) vs model \(6, 3\)"):
        other.load_state(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(before, wide.parameters()))
    assert wide_optimizer.state_dict()["state"] == {} and other.step == 0 and torch.equal(torch.get_rng_state(), rng)

    smaller_batches = make_engine(batch_size=5)
    with pytest.raises(ValueError, match="loader: the state was saved with 5 batches per epoch"):
        smaller_batches[0].load_state(tmp_path)


def test_position_applies_to_a_loader_set_up_after_load_state(tmp_path):
    engine, model, optimizer, loader = make_engine()
    train_steps(engine, model, optimizer, loader, 3)
    engine.save_state(tmp_path)
    _, _, _, reference = make_engine()  # the same epoch, iterated without stopping
    rest = [x for x, _ in reference][3:]
    later, *_ = make_engine(dataloader=False)
    later.load_state(tmp_path)
    x = torch.randn(20, 3, generator=torch.Generator().manual_seed(1))
    late_loader = later.setup_dataloader(DataLoader(TensorDataset(x, x), batch_size=4, shuffle=True))
    assert all(torch.equal(a, b) for (a, _), b in zip(late_loader, rest)) and len(rest) == 2


def test_state_directory_pointer_keep_and_stale_temporaries(tmp_path):
    engine, model, optimizer, loader = make_engine()
    (tmp_path / ".step-00000001.tmp").mkdir()  # left by a killed save
    (tmp_path / ".step-00000001.tmp" / "state.pt").write_bytes(b"partial")
    for steps in (1, 2, 3, 4):
        train_steps(engine, model, optimizer, loader, steps)
        written = engine.save_state(tmp_path, keep=2, note=steps)
    assert written.name == "step-00000004"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003", "step-00000004"]
    fresh = make_engine()[0]
    assert fresh.load_state(tmp_path) == {"note": 4}
    assert make_engine()[0].load_state(tmp_path / "step-00000003") == {"note": 3}  # a step directory directly
    (tmp_path / "latest").write_text("step-00000009 sha256:0\n")
    with pytest.raises(CheckpointCorruptError, match="latest: the pointer to the newest state is damaged"):
        make_engine()[0].load_state(tmp_path)
    (tmp_path / "latest").unlink()
    assert make_engine()[0].load_state(tmp_path) == {"note": 4}  # no pointer: the newest step directory
    with pytest.raises(FileNotFoundError, match="no saved state"):
        make_engine()[0].load_state(tmp_path / "nowhere")


def test_bad_arguments_name_themselves(tmp_path):
    engine, *_ = make_engine()
    with pytest.raises(ValueError, match="keep: expected a positive int"):
        engine.save_state(tmp_path, keep=0)
    with (
        pytest.raises(TypeError, match="handle: a .*cannot be saved in the training state"),
        open(__file__) as handle,
    ):
        engine.save_state(tmp_path, handle=handle)
    with pytest.raises(RuntimeError, match="setup"):
        dpkit.Engine(strategy="single", accelerator="cpu", devices=1, progress=False).save_state(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        engine.save_state(tmp_path / "file")


class CountingSampler(torch.utils.data.Sampler):
    """A sampler whose order comes from its own state (a counter advanced every epoch), saved by state_dict()."""

    def __init__(self, n: int):
        self.n, self.draws = n, 0

    def __iter__(self):
        self.draws += 1
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(1000 + self.draws)).tolist())

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        self.draws = state["draws"]


def test_a_sampler_with_state_resumes_its_epoch():
    data = TensorDataset(torch.arange(10))
    loader = ResumableLoader(DataLoader(data, batch_size=3, sampler=CountingSampler(10)))
    [ids.tolist() for (ids,) in loader]  # epoch 0
    iterator = iter(loader)
    next(iterator)
    position, order_state = loader.position(), loader.order_state()
    rest = [ids.tolist() for (ids,) in iterator]
    resumed = ResumableLoader(DataLoader(data, batch_size=3, sampler=CountingSampler(10)))
    resumed.resume_from(position, order_state)
    assert [ids.tolist() for (ids,) in resumed] == rest and len(rest) == 3


def test_a_save_of_the_same_step_killed_between_its_renames_loses_nothing(tmp_path):
    engine, model, optimizer, loader = make_engine()
    train_steps(engine, model, optimizer, loader, 2)
    engine.save_state(tmp_path, note="first")
    # the moment between moving the old step-00000002 aside and renaming the new one into place
    (tmp_path / "step-00000002").rename(tmp_path / ".step-00000002.old.tmp")
    assert make_engine()[0].load_state(tmp_path) == {"note": "first"}
    engine.save_state(tmp_path, note="second")  # puts the old copy back, then replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002"]
    assert make_engine()[0].load_state(tmp_path) == {"note": "second"}


def test_the_thread_count_a_loaded_state_sets_lasts_until_the_engine_closes(tmp_path):
    before = torch.get_num_threads()
    saved_with, other = (1, 2) if before != 1 else (2, 1)
    try:
        torch.set_num_threads(saved_with)
        engine = dpkit.Engine(strategy="single", accelerator="cpu", devices=1, progress=False)
        engine.setup(nn.Linear(3, 2))
        engine.save_state(tmp_path)
        engine.close()
        torch.set_num_threads(other)
        resumed = dpkit.Engine(strategy="single", accelerator="cpu", devices=1, progress=False)
        resumed.setup(nn.Linear(3, 2))
        resumed.load_state(tmp_path)
        assert torch.get_num_threads() == saved_with  # the saved run's count: its sums split alike
        resumed.close()
        assert torch.get_num_threads() == other  # the process's own count again
    finally:
        torch.set_num_threads(before)
