"""The replicated strategy: persistent replicas that stay equal, step themselves, and equal one device."""

from __future__ import annotations

import _thread
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpkit.checkpoint.model_files import clean_state_dict
from dpkit.engine.engine import Engine
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
    # on virtual CPU devices the replicas' weights are replica 0's storage and the user's optimizer holds the
    # one momentum buffer of each parameter, though every replica thread stepped a shard of them
    assert len({r[0].weight.data_ptr() for r in engine.strategy.replicas}) == 1
    assert len({id(r[0].weight) for r in engine.strategy.replicas}) == 3  # each replica its own leaf
    user_params = list(model.module.parameters())
    assert list(optimizer.state) == user_params  # in parameter order, whatever thread created an entry
    assert all("momentum_buffer" in optimizer.state[p] for p in user_params)


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
    assert deferred.shape == (5, 3)  # read like the model's output: the forward runs, gathered
    model.eval()
    assert all(not replica.training for replica in engine.strategy.replicas)
    with torch.no_grad():
        assert torch.allclose(model(x), mlp()(x), atol=1e-6)


def assert_summed_into_the_users_model(engine, model, reference):
    """On virtual CPU devices the sum is a reduce into replica 0 (the user's model), whose parameters every
    replica shares; the other replicas' gradients are released so the next backward adds only new ones."""
    for mine, theirs in zip(model.module.parameters(), reference.parameters()):
        assert torch.allclose(mine.grad, theirs.grad, atol=1e-6)
    assert all(p.grad is None for replica in engine.strategy.replicas[1:] for p in replica.parameters())


def test_arithmetic_on_the_loss_reaches_the_users_model():
    x, y = data(7)
    engine, model, _ = replicated(devices=3)
    criterion = engine.setup_criterion(F.cross_entropy)
    engine.backward(criterion(model(x), y) * 2 + 5.0)  # a factor and a constant term, outside the criterion
    reference = mlp()
    (F.cross_entropy(reference(x), y) * 2).backward()
    assert_summed_into_the_users_model(engine, model, reference)


def test_a_plain_loss_backward_runs_the_replicas_and_the_sum():
    x, y = data(9)
    engine, model, _ = replicated(devices=3)
    criterion = engine.setup_criterion(F.cross_entropy)
    criterion(model(x), y).backward()  # no engine.backward: the loss node does the work
    reference = mlp()
    F.cross_entropy(reference(x), y).backward()
    assert_summed_into_the_users_model(engine, model, reference)


def test_a_loss_without_grad_is_refused_with_the_fix():
    engine, _, _ = replicated(devices=2)
    with pytest.raises(RuntimeError, match="setup_criterion"):
        engine.backward(torch.tensor(1.0))


def test_a_second_backward_through_the_same_loss_says_why_it_fails():
    x, y = data(6)
    engine, model, _ = replicated(devices=2)
    loss = engine.setup_criterion(F.cross_entropy)(model(x), y)
    engine.backward(loss)
    with pytest.raises(RuntimeError, match="ran twice"):
        engine.backward(loss)


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


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 3))

    def forward(self, x):
        return self.body(x)


def seeded_dropout_run(steps: int = 5) -> list[torch.Tensor]:
    torch.manual_seed(0)
    engine = Engine(strategy="replicated", accelerator="cpu", devices=4)
    model = DropoutNet()
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.3))
    criterion = engine.setup_criterion(F.cross_entropy)
    x, y = data(32)
    torch.manual_seed(7)
    for _ in range(steps):
        optimizer.zero_grad()
        engine.backward(criterion(model(x), y))
        optimizer.step()
    return [p.detach().clone() for p in engine.strategy.replicas[0].parameters()]


def test_seeded_runs_with_dropout_on_four_devices_are_bitwise_equal():
    first, again = seeded_dropout_run(), seeded_dropout_run()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    torch.manual_seed(0)
    assert not all(torch.equal(a, b) for a, b in zip(first, DropoutNet().parameters())), "the run must have trained"


class BlocksOnReplicaOne(nn.Module):
    """Replica 1's forward presses Ctrl-C and then stays busy until the test lets it go, so a step is in
    flight when the interrupt arrives, however fast or slow the machine."""

    blocking = True
    hold = threading.Event()
    finished = threading.Event()

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 3)

    def forward(self, x):
        if BlocksOnReplicaOne.blocking and threading.current_thread().name.startswith("dpkit-cpu:1"):
            _thread.interrupt_main()  # what Ctrl-C does to the main thread
            BlocksOnReplicaOne.hold.wait(60.0)
            BlocksOnReplicaOne.finished.set()
        return self.linear(x)


def test_ctrl_c_during_a_replicated_step_returns_at_once_and_the_next_step_works():
    engine = Engine(strategy="replicated", accelerator="cpu", devices=2)
    model = BlocksOnReplicaOne()
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    criterion = engine.setup_criterion(F.cross_entropy)
    x, y = data(8)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.backward(criterion(model(x), y))
        assert not BlocksOnReplicaOne.finished.is_set()  # the step stopped while replica 1 was still busy
    finally:
        BlocksOnReplicaOne.blocking = False
        BlocksOnReplicaOne.hold.set()
    # the next step waits for the interrupted replica's forward to end, then runs normally
    optimizer.zero_grad()
    engine.backward(criterion(model(x), y))
    optimizer.step()
    first, second = (list(r.parameters()) for r in engine.strategy.replicas)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


class BlockInBackwardOnReplicaOne(torch.autograd.Function):
    hold = threading.Event()
    finished = threading.Event()

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if threading.current_thread().name.startswith("dpkit-cpu:1"):
            _thread.interrupt_main()
            BlockInBackwardOnReplicaOne.hold.wait(60.0)
            BlockInBackwardOnReplicaOne.finished.set()
        return grad


class LinearThen(nn.Module):
    """nn.Linear(6, 3), then an autograd Function (after the parameters, so its node is in the graph)."""

    def __init__(self, function: type[torch.autograd.Function]):
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.function = function

    def forward(self, x):
        return self.function.apply(self.linear(x))


def test_ctrl_c_during_the_replicas_backward_returns_at_once():
    engine = Engine(strategy="replicated", accelerator="cpu", devices=2)
    model = LinearThen(BlockInBackwardOnReplicaOne)
    model, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data(8)
    loss = engine.setup_criterion(F.cross_entropy)(model(x), y)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.backward(loss)
        assert not BlockInBackwardOnReplicaOne.finished.is_set()  # replica 1's backward was still running
    finally:
        BlockInBackwardOnReplicaOne.hold.set()


FREED_IN: list[str] = []  # module-level: a list on the model would be deep-copied with each replica


class _FreedWhere:
    """Notes the thread that frees it: stored on an autograd node, it goes when that node's graph goes."""

    def __del__(self):
        FREED_IN.append(threading.current_thread().name)


class _Marked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.marker = _FreedWhere()
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_each_replicas_graph_is_freed_in_its_own_thread_not_the_callers():
    """A deep model's graph takes milliseconds to free; the caller would do it while every replica waits."""
    FREED_IN.clear()
    engine = Engine(strategy="replicated", accelerator="cpu", devices=2, progress=False)
    model = LinearThen(_Marked)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    criterion = engine.setup_criterion(F.cross_entropy)
    engine.backward(criterion(model(torch.randn(6, 6)), torch.randint(0, 3, (6,))))
    assert sorted(FREED_IN) == ["dpkit-cpu:0_0", "dpkit-cpu:1_0"]
