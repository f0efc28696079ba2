"""engine.setup refuses an optimizer that would train something else than the model, under every strategy, and
Engine(nonfinite_loss=...) warns about or stops at a loss that is nan or inf (off by default)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from dpkit import Engine, NonFiniteLoss
from dpkit.launch.network import free_port
from dpkit.strategies import PER_DEVICE, available_strategies, strategy_class

ONE_PROCESS_GROUP = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def model():
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


@pytest.fixture
def engine_for(monkeypatch):
    """Engine(strategy) on CPU devices: two in one process, or one process of a group of one (ddp, fsdp, …)."""
    made = []

    def make(strategy, **options):
        traits = strategy_class(strategy).traits
        devices = 2 if traits.processes != PER_DEVICE and traits.max_devices is None else 1
        if traits.processes == PER_DEVICE:
            for name, value in {
                **ONE_PROCESS_GROUP,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
            }.items():
                monkeypatch.setenv(name, value)
        engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False, **options)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@pytest.mark.parametrize("strategy", available_strategies())
def test_setup_refuses_an_optimizer_over_another_models_parameters(engine_for, strategy):
    trained, other = model(), model()
    with pytest.raises(ValueError) as refused:
        engine_for(strategy).setup(trained, torch.optim.SGD(other.parameters(), lr=0.1))
    assert str(refused.value).startswith(
        "optimizer: 4 of its 4 parameters are not the model's (the first has shape (3, 4)), so steps would leave "
        "the model as it is; build the optimizer from this model's parameters"
    )


def test_setup_refuses_one_foreign_parameter_mixed_in_and_takes_part_of_the_model():
    trained = model()
    stray = nn.Parameter(torch.zeros(7, 5))
    mixed = torch.optim.SGD([*trained.parameters(), stray], lr=0.1)
    with pytest.raises(
        ValueError, match=r"^optimizer: 1 of its 5 parameters are not the model's \(the first has shape"
    ):
        Engine(strategy="replicated", accelerator="cpu", devices=2, progress=False).setup(trained, mixed)
    # an optimizer over part of the model (fine-tuning the head) is the model's
    head_only = torch.optim.SGD(trained[2].parameters(), lr=0.1)
    Engine(strategy="single", accelerator="cpu", devices=1, progress=False).setup(trained, head_only)


def _one_step(engine, poison):
    net = model()
    net, optimizer = engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    optimizer.zero_grad()
    loss = net(torch.ones(4, 4)).abs().sum() * poison
    engine.backward(loss)
    optimizer.step()
    return net


def test_nonfinite_loss_is_off_by_default_warns_once_or_stops(caplog):
    with caplog.at_level(logging.WARNING, logger="dpkit"):
        _one_step(Engine(strategy="single", accelerator="cpu", progress=False), float("nan"))
    assert not [record for record in caplog.records if "loss is" in record.getMessage()]

    caplog.clear()
    engine = Engine(strategy="single", accelerator="cpu", progress=False, nonfinite_loss="warn")
    with caplog.at_level(logging.WARNING, logger="dpkit"):
        _one_step(engine, float("inf"))
    said = [record.getMessage() for record in caplog.records if "loss is" in record.getMessage()]
    assert said == [
        "engine.backward: the loss is inf at step 1; the step would make every weight it touches nan: lower the "
        "learning rate, clip the gradients (engine.clip_gradients) or look at the batch"
    ]

    engine = Engine(strategy="single", accelerator="cpu", progress=False, nonfinite_loss="raise")
    with pytest.raises(NonFiniteLoss, match=r"^engine.backward: the loss is nan at step 1;"):
        _one_step(engine, float("nan"))
    assert engine.step == 0  # stopped before the backward: nothing stepped

    with pytest.raises(ValueError, match=r"^nonfinite_loss: expected None \(no check\), 'warn' or 'raise', got 'yes'"):
        Engine(strategy="single", accelerator="cpu", progress=False, nonfinite_loss="yes")
