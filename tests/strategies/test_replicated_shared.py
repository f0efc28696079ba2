"""replicated on virtual CPU devices shares replica 0's weights and steps the user's optimizer once, in
per-thread shards. It must be the same arithmetic as the layout GPUs get (a copy and an optimizer per
device, share_weights=False), bit for bit, and the user's optimizer must still behave as one optimizer."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from dpkit.engine.engine import Engine
from dpkit.observe import Observer
from dpkit.strategies import replica_optimizers
from dpkit.strategies.replica_optimizers import SharedOptimizer, balanced_shards, even_runs


@pytest.fixture(autouse=True)
def shard_small_models(monkeypatch, request):
    """These models are tiny; the sharded step is what most tests here check, so shard from one element."""
    if "whole" not in request.node.name:
        monkeypatch.setattr(replica_optimizers, "MIN_SHARDED_ELEMENTS", 1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.body(x))


def data(rows: int = 11, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=generator), torch.randint(0, 3, (rows,), generator=generator)


OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.3, momentum=0.9, nesterov=True),
    "adam": lambda params: torch.optim.Adam(params, lr=0.05, amsgrad=True),
    "adamw-two-groups": lambda params: torch.optim.AdamW(
        [{"params": params[:2], "lr": 0.02}, {"params": params[2:], "weight_decay": 0.3}], lr=0.05
    ),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=0.01, momentum=0.5),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
}


class WideNet(Net):
    """A hidden layer of 64 x 2048 weights: the sharded step cuts it in pieces (one per device thread)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 2048), nn.Tanh())
        self.head = nn.Linear(2048, 3)


def train(share_weights: bool | None, make_optimizer, devices: int = 3, steps: int = 4, net=Net):
    engine = Engine(
        strategy="replicated", accelerator="cpu", devices=devices, progress=False, share_weights=share_weights
    )
    model = net()
    model, optimizer = engine.setup(model, make_optimizer(list(model.parameters())))
    criterion = engine.setup_criterion(F.cross_entropy)
    for step in range(steps):
        x, y = data(11, seed=step)  # 4, 4, 3 rows
        optimizer.zero_grad()
        engine.backward(criterion(model(x), y))
        optimizer.step()
    return engine, model, optimizer


CUT_OPTIMIZERS = {  # every kind of elementwise state: moments, a max, per-element step sizes, scalar tensors
    **OPTIMIZERS,
    "rprop": lambda params: torch.optim.Rprop(params, lr=0.01),
    "asgd": lambda params: torch.optim.ASGD(params, lr=0.05, t0=1),
    "nadam": lambda params: torch.optim.NAdam(params, lr=0.05),
    "adamax": lambda params: torch.optim.Adamax(params, lr=0.05),
    "sgd-plain": lambda params: torch.optim.SGD(params, lr=0.1),
    "adam-fused": lambda params: torch.optim.Adam(params, lr=0.05, fused=True),
    "sgd-foreach-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True),
    "radam-maximize-decay": lambda params: torch.optim.RAdam(params, lr=0.05, maximize=True, weight_decay=0.1),
    "adadelta": lambda params: torch.optim.Adadelta(params),
}


def assert_same_training(shared, shared_optimizer, copies, copies_optimizer):
    for mine, theirs in zip(shared.module.parameters(), copies.module.parameters()):
        assert torch.equal(mine, theirs)
    # the user's optimizer holds the whole state, in the order one optimizer over all parameters gives it
    mine, theirs = shared_optimizer.state_dict(), copies_optimizer.state_dict()
    assert list(mine["state"]) == list(theirs["state"]) == sorted(theirs["state"])
    for index, state in theirs["state"].items():
        assert state.keys() == mine["state"][index].keys()
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(mine["state"][index][key])), (index, key)
    assert mine["param_groups"] == theirs["param_groups"]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_shared_weights_equal_a_copy_per_device_bit_for_bit(name):
    shared_engine, shared, shared_optimizer = train(None, OPTIMIZERS[name])
    copies_engine, copies, copies_optimizer = train(False, OPTIMIZERS[name])
    assert shared_engine.strategy.shares_weights and not copies_engine.strategy.shares_weights
    assert isinstance(shared_optimizer.optimizer, SharedOptimizer) and shared_optimizer.optimizer.shardable()
    assert_same_training(shared, shared_optimizer, copies, copies_optimizer)


@pytest.mark.parametrize("name", sorted(CUT_OPTIMIZERS))
def test_a_parameter_cut_between_threads_steps_bit_for_bit_as_one_tensor(name):
    shared_engine, shared, shared_optimizer = train(None, CUT_OPTIMIZERS[name], net=WideNet)
    _, copies, copies_optimizer = train(False, CUT_OPTIMIZERS[name], net=WideNet)
    pieces = shared_optimizer.optimizer._pieces
    weight = shared.module.module.body[2].weight
    assert [p is weight for _, p, _, _ in pieces] == [True, True, True]  # one piece per device thread
    assert all(lo % replica_optimizers.CUT_ALIGN_ELEMENTS == 0 for _, _, lo, _ in pieces)
    assert not any(piece in shared_optimizer.state for piece, _, _, _ in pieces)  # lent for the step only
    assert_same_training(shared, shared_optimizer, copies, copies_optimizer)


def test_a_cut_parameter_resumes_from_a_loaded_state_bit_for_bit():
    straight_engine, straight, straight_optimizer = train(None, CUT_OPTIMIZERS["adam"], net=WideNet, steps=4)
    first_engine, first, first_optimizer = train(None, CUT_OPTIMIZERS["adam"], net=WideNet, steps=2)
    engine = Engine(strategy="replicated", accelerator="cpu", devices=3, progress=False)
    model = WideNet()
    model, optimizer = engine.setup(model, torch.optim.Adam(model.parameters(), lr=0.05, amsgrad=True))
    model.module.load_state_dict(first.module.state_dict())
    engine.strategy.weights_loaded()
    optimizer.load_state_dict(first_optimizer.state_dict())
    criterion = engine.setup_criterion(F.cross_entropy)
    for step in (2, 3):
        x, y = data(11, seed=step)
        optimizer.zero_grad()
        engine.backward(criterion(model(x), y))
        optimizer.step()
    assert optimizer.optimizer._pieces  # the loaded state was stepped in pieces
    assert_same_training(model, optimizer, straight, straight_optimizer)


def test_even_runs_cut_large_parameters_on_aligned_elements_and_move_other_cuts_to_an_edge():
    align, large = replica_optimizers.CUT_ALIGN_ELEMENTS, replica_optimizers.MIN_CUT_ELEMENTS * 3
    sizes = [10, large, 7, large, 0, 5]
    runs = even_runs(sizes, 4, [True] * len(sizes))
    covered = collections.defaultdict(list)
    for run in runs:
        assert [position for position, _, _ in run] == sorted(position for position, _, _ in run)
        for position, lo, hi in run:
            covered[position].append((lo, hi))
            assert lo % align == 0 or lo == 0
    for position, size in enumerate(sizes):  # every element exactly once, the empty parameter too
        spans = sorted(covered[position])
        assert spans[0][0] == 0 and spans[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    loads = [sum(hi - lo for _, lo, hi in run) for run in runs]
    assert max(loads) - min(loads) <= 2 * align
    uncut = even_runs(sizes, 4, [True, False, True, False, True, True])
    assert all((lo, hi) == (0, sizes[position]) for run in uncut for position, lo, hi in run)
    assert len(even_runs([3], 4, [True])) == 1  # no empty shard optimizers


def test_replicas_share_storage_and_keep_their_own_leaves_and_buffers():
    engine = Engine(strategy="replicated", accelerator="cpu", devices=2, progress=False)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    first, second = engine.strategy.replicas
    for a, b in zip(first.parameters(), second.parameters()):
        assert a.data_ptr() == b.data_ptr() and a is not b
    for a, b in zip(first.buffers(), second.buffers()):
        assert a.data_ptr() != b.data_ptr()  # each replica updates its own running statistics in its thread


def test_the_step_splits_the_parameters_evenly_by_size():
    sizes = [torch.empty(n) for n in (100, 10, 60, 50, 5, 1)]
    shards = balanced_shards(sizes, 2)
    loads = sorted(sum(sizes[k].numel() for k in shard) for shard in shards)
    assert loads == [111, 115]
    assert sorted(k for shard in shards for k in shard) == list(range(6))
    assert all(shard == sorted(shard) for shard in shards)
    assert len(balanced_shards(sizes[:1], 3)) == 1  # no empty shard optimizers


def test_a_scheduler_on_the_users_optimizer_sees_its_steps_and_sets_every_shards_lr():
    engine = Engine(strategy="replicated", accelerator="cpu", devices=2, progress=False)
    model = Net()
    user_optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = engine.setup(model, user_optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(user_optimizer, step_size=1, gamma=0.0)  # lr 0 after one step
    criterion = engine.setup_criterion(F.cross_entropy)
    x, y = data(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when scheduler.step() comes before any optimizer.step()
        optimizer.zero_grad()
        engine.backward(criterion(model(x), y))
        optimizer.step()
        scheduler.step()
    before = [p.clone() for p in model.module.parameters()]
    optimizer.zero_grad()
    engine.backward(criterion(model(x), y))
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters()))  # every shard got lr 0


def test_an_optimizer_with_its_own_step_hook_steps_unsplit_and_once():
    engine = Engine(strategy="replicated", accelerator="cpu", devices=3, progress=False)
    model = Net()
    user_optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    calls = []
    user_optimizer.register_step_post_hook(lambda optimizer, args, kwargs: calls.append(optimizer))
    model, optimizer = engine.setup(model, user_optimizer)
    assert not optimizer.optimizer.shardable()
    criterion = engine.setup_criterion(F.cross_entropy)
    x, y = data(9)
    reference = Net()
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    for _ in range(2):
        optimizer.zero_grad()
        engine.backward(criterion(model(x), y))
        optimizer.step()
        reference_optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        reference_optimizer.step()
    assert calls == [user_optimizer, user_optimizer]
    for mine, theirs in zip(model.module.parameters(), reference.parameters()):
        assert torch.allclose(mine, theirs, atol=1e-6)


def test_a_global_optimizer_hook_sees_the_users_optimizer_once_per_step():
    engine = Engine(strategy="replicated", accelerator="cpu", devices=3, progress=False)
    model = WideNet()
    user_optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    model, optimizer = engine.setup(model, user_optimizer)
    criterion = engine.setup_criterion(F.cross_entropy)
    assert optimizer.optimizer.shardable()
    seen = []
    handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: seen.append(opt))
    try:
        assert not optimizer.optimizer.shardable()
        for step in range(2):
            x, y = data(9, seed=step)
            optimizer.zero_grad()
            engine.backward(criterion(model(x), y))
            optimizer.step()
    finally:
        handle.remove()
    assert seen == [user_optimizer, user_optimizer]
    assert optimizer.optimizer.shardable()  # split again once the hook is gone
    with Observer("cpu:0"):  # dpkit's own observer times each shard in its thread: the step stays split
        assert optimizer.optimizer.shardable()


def test_a_small_model_steps_whole_on_the_calling_thread():
    engine = Engine(strategy="replicated", accelerator="cpu", devices=2, progress=False)
    small, large = Net(), nn.Linear(1024, 1024)
    _, small_optimizer = engine.setup(small, torch.optim.SGD(small.parameters(), lr=0.1))
    assert not small_optimizer.optimizer.shardable()  # a few hundred elements: hand-offs would cost more
    other = Engine(strategy="replicated", accelerator="cpu", devices=2, progress=False)
    _, large_optimizer = other.setup(large, torch.optim.SGD(large.parameters(), lr=0.1))
    assert large_optimizer.optimizer.shardable()  # 1024 * 1025 elements


def test_lbfgs_is_not_split():
    engine = Engine(strategy="replicated", accelerator="cpu", devices=2, progress=False)
    model = Net()
    _, optimizer = engine.setup(model, torch.optim.LBFGS(model.parameters()))
    assert isinstance(optimizer.optimizer, SharedOptimizer) and not optimizer.optimizer.shardable()


@pytest.mark.parametrize("share_weights", [None, False])
def test_two_summed_backwards_before_one_step_count_each_gradient_once(share_weights):
    """Two backwards, each ending with the sum, add up as on one device: the second sum must not count the
    first one's result again in every replica."""
    engine = Engine(strategy="replicated", accelerator="cpu", devices=3, progress=False, share_weights=share_weights)
    model = Net()
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    criterion = engine.setup_criterion(F.cross_entropy)
    reference = Net()
    for seed in (1, 2):
        x, y = data(10, seed)
        if seed == 1:
            criterion(model(x), y).backward()
        else:
            engine.backward(criterion(model(x), y))
        F.cross_entropy(reference(x), y).backward()
    for mine, theirs in zip(model.module.parameters(), reference.parameters()):
        assert torch.allclose(mine.grad, theirs.grad, atol=1e-6)
    optimizer.step()
    for mine, theirs in zip(model.module.parameters(), reference.parameters()):
        assert torch.allclose(mine, theirs - 0.1 * theirs.grad, atol=1e-6)


def test_share_weights_true_needs_virtual_cpu_devices():
    from dpkit.strategies.replicated import Replicated

    with pytest.raises(ValueError, match="share_weights: True needs virtual CPU devices"):
        Replicated([torch.device("cuda", 0), torch.device("cuda", 1)], share_weights=True)
    with pytest.raises(TypeError, match="share_weights: expected True, False or None"):
        Replicated([torch.device("cpu", 0), torch.device("cpu", 1)], share_weights="yes")
