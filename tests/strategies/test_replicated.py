"""The replicated strategy: persistent replicas that stay equal, step themselves, and equal one device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpkit.checkpoint import clean_state_dict
from dpkit.engine import Engine
from dpkit.strategies.base import DeferredOutput


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(rows: int = 11):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 6, generator=generator), torch.randint(0, 3, (rows,), generator=generator)


def reference_step(x, y, lr=0.5, momentum=0.9, steps=3):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model


def replicated(devices=3, lr=0.5, momentum=0.9):
    engine = Engine(strategy="replicated", accelerator="cpu", devices=devices)
    model = mlp()
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum))
    return engine, model, optimizer


def assert_replicas_equal(engine, reference: nn.Module, atol=1e-6):
    for replica in engine.strategy.replicas:
        for (name, mine), theirs in zip(replica.named_parameters(), reference.parameters()):
            assert torch.allclose(mine, theirs, atol=atol), name


def test_steps_equal_one_device_with_momentum_and_uneven_shares():
    x, y = data(11)  # 4, 4, 3 rows
    engine, model, optimizer = replicated()
    criterion = engine.setup_criterion(F.cross_entropy)
    for _ in range(3):
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        engine.backward(loss)
        optimizer.step()
    reference = reference_step(x, y)
    assert_replicas_equal(engine, reference)
    # each replica has its own optimizer with its own momentum buffers
    buffers = [opt.state[p]["momentum_buffer"] for opt, p in zip(optimizer.optimizers, [r[0].weight for r in engine.strategy.replicas])]
    assert len({b.data_ptr() for b in buffers}) == 3


def test_the_returned_loss_is_the_global_mean():
    x, y = data(11)
    engine, model, _ = replicated()
    criterion = engine.setup_criterion(F.cross_entropy)
    loss = criterion(model(x), y)
    assert loss.item() == pytest.approx(F.cross_entropy(mlp()(x), y).item(), abs=1e-6)


def test_without_setup_criterion_outputs_are_gathered_and_still_exact():
    x, y = data(11)
    engine, model, optimizer = replicated()
    for _ in range(3):
        optimizer.zero_grad()
        out = model(x)
        assert isinstance(out, torch.Tensor) and out.shape == (11, 3)
        engine.backward(F.cross_entropy(out, y))
        optimizer.step()
    assert_replicas_equal(engine, reference_step(x, y))


def test_eval_returns_outputs_and_training_returns_a_deferred_output():
    x, _ = data(5)
    engine, model, _ = replicated(devices=2)
    engine.setup_criterion(F.cross_entropy)
    deferred = model(x)
    assert isinstance(deferred, DeferredOutput)
    with pytest.raises(AttributeError, match="setup_criterion"):
        deferred.shape
    model.eval()
    assert all(not replica.training for replica in engine.strategy.replicas)
    with torch.no_grad():
        assert torch.allclose(model(x), mlp()(x), atol=1e-6)


def test_a_changed_loss_is_refused_with_the_fix():
    x, y = data(6)
    engine, model, _ = replicated(devices=2)
    criterion = engine.setup_criterion(F.cross_entropy)
    loss = criterion(model(x), y)
    with pytest.raises(RuntimeError, match="inside that criterion"):
        engine.backward(loss * 2)


def test_learning_rate_changes_reach_every_replica():
    x, y = data(8)
    engine, model, optimizer = replicated(devices=2, momentum=0.0)
    criterion = engine.setup_criterion(F.cross_entropy)
    optimizer.param_groups[0]["lr"] = 0.0  # e.g. a scheduler on the user's optimizer
    before = [p.clone() for p in engine.strategy.replicas[1].parameters()]
    optimizer.zero_grad()
    engine.backward(criterion(model(x), y))
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, engine.strategy.replicas[1].parameters()))


def test_an_error_in_a_replica_names_it():
    engine, model, _ = replicated(devices=2)
    criterion = engine.setup_criterion(F.cross_entropy)
    with pytest.raises(RuntimeError, match="replica 0 on device cpu:0"):
        criterion(model(torch.randn(4, 7)), torch.zeros(4, dtype=torch.long))  # wrong feature count


def test_inputs_and_targets_must_agree_on_rows():
    engine, model, _ = replicated(devices=2)
    criterion = engine.setup_criterion(F.cross_entropy)
    with pytest.raises(ValueError, match="batch size"):
        criterion(model(torch.randn(4, 6)), torch.zeros(5, dtype=torch.long))


@pytest.mark.parametrize("strategy,devices", [("single", 1), ("dp", 2), ("replicated", 3), ("dp-balanced", 2)])
def test_accumulating_two_micro_batches_equals_one_step_on_both(strategy, devices):
    x, y = data(16)
    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, accumulate=2)
    model = mlp()
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    criterion = engine.setup_criterion(F.cross_entropy)
    for _ in range(2):  # two optimizer steps, each over two halves
        for half in (slice(0, 8), slice(8, 16)):
            optimizer.zero_grad()
            engine.backward(criterion(model(x[half]), y[half]))
            optimizer.step()
    reference = reference_step(x, y, steps=2).state_dict()
    trained = clean_state_dict(model)  # what dpkit.save_model writes
    assert list(trained) == list(reference)
    for key in reference:
        assert torch.allclose(trained[key], reference[key], atol=1e-6), key


def test_a_batch_smaller_than_the_device_count_leaves_replicas_idle_but_equal():
    x, y = data(2)  # 1, 1, 0 rows on three devices
    engine, model, optimizer = replicated(devices=3)
    criterion = engine.setup_criterion(F.cross_entropy)
    for _ in range(3):
        optimizer.zero_grad()
        engine.backward(criterion(model(x), y))
        optimizer.step()
    assert_replicas_equal(engine, reference_step(x, y))


def test_adamw_with_a_scheduler_on_the_users_optimizer_equals_one_device():
    x, y = data(10)

    def train(engine_devices: int | None):
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        step_model, step_optimizer, criterion, engine = model, optimizer, F.cross_entropy, None
        if engine_devices:
            engine = Engine(strategy="replicated", accelerator="cpu", devices=engine_devices)
            step_model, step_optimizer = engine.setup(model, optimizer)
            criterion = engine.setup_criterion(F.cross_entropy)
        for _ in range(3):
            step_optimizer.zero_grad()
            loss = criterion(step_model(x), y)
            engine.backward(loss) if engine else loss.backward()
            step_optimizer.step()
            scheduler.step()
        return engine, model

    engine, _ = train(3)
    _, reference = train(None)
    assert_replicas_equal(engine, reference, atol=1e-5)
