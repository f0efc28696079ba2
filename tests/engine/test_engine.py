"""The Engine: one loop for every strategy, clear errors, rank-0 helpers and clean checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpkit
from dpkit.engine.engine import Engine
from dpkit.examples.digits import DigitsMLP
from dpkit.launch import LAUNCH_VARIABLES
from dpkit.strategies import available_strategies, strategy_class
from dpkit.strategies.base import DeferredOutput

IN_PROCESS = [("single", 1), ("dp", 2), ("dp-balanced", 2), ("replicated", 3)]


def test_every_strategy_is_a_module_found_by_name():
    # the registry's order starts with these; strategies added later (zero, hsdp) come after them
    assert available_strategies()[:6] == ["single", "dp", "dp-balanced", "replicated", "ddp", "fsdp"]
    for name in available_strategies():
        assert strategy_class(name).name == name


def test_unknown_strategy_lists_the_choices():
    with pytest.raises(
        ValueError, match="strategy: unknown strategy 'horovod'; choose one of single, dp, dp-balanced, replicated, ddp"
    ):
        Engine(strategy="horovod", accelerator="cpu")


def test_single_with_several_devices_says_what_to_do():
    with pytest.raises(ValueError, match="devices=1"):
        Engine(strategy="single", accelerator="cpu", devices=2)


def test_single_defaults_to_one_device_and_others_to_two_cpu_devices():
    assert Engine(strategy="single", accelerator="cpu").devices == [torch.device("cpu", 0)]
    assert Engine(strategy="dp", accelerator="cpu").devices == dpkit.cpu_devices(2)


def test_ddp_outside_a_launcher_points_to_dpkit_launch(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="dpkit launch --nproc-per-node N"):
        Engine(strategy="ddp", accelerator="cpu", devices=2)


@pytest.mark.parametrize("accumulate,error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_accumulate_must_be_a_positive_int(accumulate, error):
    with pytest.raises(error, match="accumulate: expected a positive int"):
        Engine(strategy="single", accelerator="cpu", accumulate=accumulate)


def test_setup_criterion_needs_setup_first():
    engine = Engine(strategy="replicated", accelerator="cpu", devices=2)
    with pytest.raises(RuntimeError, match="engine.setup"):
        engine.setup_criterion(F.cross_entropy)


def test_setup_rejects_what_is_not_a_model_or_optimizer():
    engine = Engine(strategy="single", accelerator="cpu")
    with pytest.raises(TypeError, match="model"):
        engine.setup(lambda x: x)
    engine = Engine(strategy="single", accelerator="cpu")
    with pytest.raises(TypeError, match="optimizer"):
        engine.setup(nn.Linear(2, 2), object())


@pytest.mark.parametrize("strategy,devices", IN_PROCESS)
def test_the_same_loop_trains_and_saves_a_clean_state_dict(tmp_path, strategy, devices):
    torch.manual_seed(0)
    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices)
    model = DigitsMLP()
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    x, y = torch.rand(32, 64), torch.randint(0, 10, (32,))
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        engine.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    engine.save(model, tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert list(state) == list(DigitsMLP().state_dict())
    bare = DigitsMLP()
    bare.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(bare(x), model(x), atol=1e-6)


def test_loss_in_replicas_strategies_defer_only_while_training_with_grad():
    engine = Engine(strategy="dp-balanced", accelerator="cpu", devices=2)
    module = nn.Linear(4, 2)
    model, _ = engine.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    x = torch.randn(6, 4)
    assert isinstance(model(x), torch.Tensor)  # no criterion set up yet: plain outputs
    criterion = engine.setup_criterion(F.mse_loss)
    assert isinstance(model(x), DeferredOutput)
    with torch.no_grad():
        assert isinstance(model(x), torch.Tensor)
    loss = criterion(model(x), torch.zeros(6, 2))
    assert loss.dim() == 0 and loss.requires_grad
    assert criterion(module(x), torch.zeros(6, 2)).item() == pytest.approx(
        loss.item(), abs=1e-6
    )  # plain outputs still work


def test_in_one_process_reduce_and_gather_are_identities():
    engine = Engine(strategy="replicated", accelerator="cpu", devices=2)
    assert engine.reduce(3.0, "sum").item() == 3.0
    assert engine.reduce(torch.tensor(2.0), "mean", weight=7).item() == 2.0
    rows = torch.arange(6).reshape(3, 2)
    assert torch.equal(engine.gather(rows), rows)
    with pytest.raises(ValueError, match="op"):
        engine.reduce(1.0, "max")
    with pytest.raises(TypeError, match="rows"):
        engine.gather(torch.tensor(1.0))


def test_progress_shows_on_rank_zero_unless_disabled():
    assert not Engine(strategy="single", accelerator="cpu").progress(range(3)).disable
    assert Engine(strategy="single", accelerator="cpu", progress=False).progress(range(3)).disable


@pytest.mark.parametrize("strategy,devices", IN_PROCESS)
def test_load_puts_a_checkpoint_into_every_replica(tmp_path, strategy, devices):
    torch.manual_seed(1)
    saved = DigitsMLP()
    dpkit.save_model(saved, tmp_path / "model.pt")
    torch.manual_seed(2)
    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices)
    model = DigitsMLP()
    model, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.load(tmp_path / "model.pt")
    x = torch.rand(9, 64)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(x), saved(x), atol=1e-6)  # every replica answers with the loaded weights


@pytest.mark.parametrize("strategy,devices", [("single", 1), ("dp", 2), ("replicated", 2)])
def test_step_after_a_plain_backward_is_an_error_not_a_silent_no_op(strategy, devices):
    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False)
    model = nn.Linear(3, 2)
    before = model.weight.detach().clone()
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    criterion = engine.setup_criterion(nn.MSELoss())
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    criterion(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"engine.backward\(loss\) instead of loss.backward\(\)"):
        optimizer.step()
    optimizer.zero_grad()
    engine.backward(criterion(model(x), y))
    optimizer.step()
    assert not torch.equal(dpkit.unwrap_model(model).weight, before)
