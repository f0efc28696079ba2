"""A run's result does not depend on the machine's timing or on what its process ran before. What the replica
runner learns by measuring (forwards and backwards side by side or in turns, on worker threads or the calling
thread) changes no floating-point sum, so a run resumed under the other way ends bitwise where the uninterrupted
run (learning as it goes) ends; the intra-op thread count, which does change large sums, is the run's (recorded in
the state, taken again on resume; `dpkit train` sets it from the machine); `auto`'s measured choice is made once.
docs/faults.md lists every such choice."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import dpkit
from dpkit.checkpoint.model_files import clean_state_dict
from dpkit.parallel.concurrency import concurrency_decided

STEPS, STOP = 6, 3


def run(strategy, state_dir, *, way=None, stop_at=None, resume=False):
    """Train STEPS steps (or save at `stop_at`) with the replica runner's way forced (`way`) or learned (None)."""
    engine = dpkit.Engine(strategy=strategy, accelerator="cpu", devices=2, progress=False)
    torch.manual_seed(0)
    # wide enough that a sum's order would show in the last bits; dropout draws from the replicas' generators
    model = nn.Sequential(nn.Linear(16, 96), nn.ReLU(), nn.Dropout(0.2), nn.Linear(96, 4))
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(120, 16, generator=generator), torch.randint(0, 4, (120,), generator=generator))
    loader = engine.setup_dataloader(
        DataLoader(data, batch_size=30, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(5)))
    )
    if resume:
        engine.load_state(state_dir)
    forced = concurrency_decided("serial" if way else "threads") if way is not None else torch.enable_grad()
    with forced:
        while engine.step < STEPS:
            for x, y in loader:
                optimizer.zero_grad()
                engine.backward(criterion(model(x), y))
                optimizer.step()
                if engine.step == stop_at:
                    engine.save_state(state_dir)
                    engine.close()
                    return None
                if engine.step == STEPS:
                    break
    engine.close()
    return {key: value.clone() for key, value in clean_state_dict(model).items()}


@pytest.mark.parametrize("strategy", ["dp", "replicated"])
@pytest.mark.parametrize("before,after", [(False, True), (True, False)])
def test_a_resume_under_the_other_way_of_the_replica_runner_ends_bitwise_equal(tmp_path, strategy, before, after):
    whole = run(strategy, tmp_path, way=None)
    run(strategy, tmp_path, way=before, stop_at=STOP)
    resumed = run(strategy, tmp_path, way=after, resume=True)
    assert all(torch.equal(resumed[key], whole[key]) for key in whole)


def run_single(state_dir, *, stop_at=None, resume=False):
    """One device, rows enough (2048) that a matrix product's inner sum is split among intra-op threads."""
    engine = dpkit.Engine(strategy="single", accelerator="cpu", progress=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(2048, 64, generator=generator), torch.randint(0, 10, (2048,), generator=generator)
    if resume:
        engine.load_state(state_dir)
    while engine.step < (stop_at or 4):
        optimizer.zero_grad()
        engine.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
    if stop_at:
        engine.save_state(state_dir)
    return {key: value.clone() for key, value in clean_state_dict(model).items()}


@pytest.fixture
def threads_back():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_resume_computes_with_the_intra_op_threads_of_the_run_it_continues(tmp_path, threads_back):
    torch.set_num_threads(2)
    whole = run_single(tmp_path / "unused")
    run_single(tmp_path, stop_at=2)
    torch.set_num_threads(1)  # another process, another machine: the resumed run keeps the saved run's count
    resumed = run_single(tmp_path, resume=True)
    assert torch.get_num_threads() == 2
    assert all(torch.equal(resumed[key], whole[key]) for key in whole)


def test_dpkit_train_computes_with_the_machines_threads_whatever_its_process_ran_before(tmp_path, threads_back):
    from dpkit.cli.main import main

    models = []
    for threads in (1, 2):
        torch.set_num_threads(threads)  # as a test or a notebook may have left it
        out = tmp_path / f"after-{threads}"
        argv = ["train", "--accelerator", "cpu", "--no-progress", "--out", str(out), "--steps", "2"]
        assert main([*argv, "--batch-size", "1024"]) == 0
        assert torch.get_num_threads() == threads  # the caller's count back
        models.append(torch.load(out / "model.pt", weights_only=True))
    assert all(torch.equal(models[0][key], models[1][key]) for key in models[0])


def test_a_resumed_auto_run_continues_with_the_strategy_its_run_chose_without_measuring(tmp_path, monkeypatch, capsys):
    from dpkit.cli.main import main
    from dpkit.plan.auto import Choice
    from dpkit.recipe import recipe

    out = tmp_path / "run"
    argv = ["train", "--accelerator", "cpu", "--no-progress", "--out", str(out), "--devices", "3"]
    argv += ["--checkpoint-every", "1", "--batch-size", "30"]
    # what the machine's timing chose when the run began: replicated on 2 of the 3 devices
    chosen = Choice("replicated", 2, "auto: replicated on 2 devices (measured)", [], "2 virtual CPU devices")
    monkeypatch.setattr(recipe, "choose_strategy", lambda *args, **kwargs: chosen)
    assert main([*argv, "--steps", "1"]) == 0

    def measured_again(*args, **kwargs):
        raise AssertionError("auto measured again on resume")

    monkeypatch.setattr(recipe, "choose_strategy", measured_again)
    capsys.readouterr()
    assert main([*argv, "--steps", "2", "--resume"]) == 0
    said = capsys.readouterr().out
    assert "dpkit train: auto: replicated, as chosen when the run began (recorded in run.json)" in said, said
    settings = json.loads((out / "run.json").read_text())
    assert (settings["strategy"], settings["devices"]) == ("replicated", ["cpu:0", "cpu:1"])
