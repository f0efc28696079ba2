"""DataParallel's kept replicas (parallel/replica_cache.py) are never stale: after every way a module can change
between calls, a wrapper that keeps its replicas computes exactly what one that builds them anew at every call
(as torch does) computes, outputs and gradients; and what a forward sets on a replica never reaches the next."""

import copy
import pickle
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import dpkit
from closeness import assert_close_to_scale
from dpkit import DataParallel

DEVICES = dpkit.cpu_devices(2)


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def twins(build, **kwargs):
    """The same model twice: under a DataParallel that keeps its replicas and under one that does not."""
    torch.manual_seed(0)
    kept = build()
    fresh = copy.deepcopy(kept)
    return (kept, DataParallel(kept, DEVICES, **kwargs)), (fresh, DataParallel(fresh, DEVICES, cache_replicas=False))


def run(model, dp, x):
    """Output and every parameter's gradient after one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = dp(x)
    if out.requires_grad:
        out.square().sum().backward()
    return out.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_same(a, b):
    """Within float64 rounding of the values' size: kept replicas sum their gradients in one autograd node, fresh
    ones in one per parameter."""
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert out_a.dtype == out_b.dtype
    assert_close_to_scale(out_a, out_b, what="outputs")
    if any(g is not None for g in grads_b):
        assert_close_to_scale(grads_a, grads_b, what="gradients")
    else:
        assert all(g is None for g in grads_a)


def check_change(build, change, x=None, *, rebuilds=True):
    """Both twins run, change alike, run again: equal results each time; the kept twin rebuilt its replicas
    after the change (or, with rebuilds=False, kept them)."""
    (kept, kept_dp), (fresh, fresh_dp) = twins(build)
    x = torch.randn(6, 4, dtype=torch.float64) if x is None else x
    for _ in range(2):
        assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))
    builds = kept_dp.replica_cache.builds
    assert builds == len(DEVICES)  # the second call kept the first call's replicas
    for model in (kept, fresh):
        torch.manual_seed(1)  # a change that draws (a new layer, spectral norm's vectors) draws alike
        change(model)
    for _ in range(2):
        assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))
    assert kept_dp.replica_cache.builds == (2 * builds if rebuilds else builds)
    return kept, kept_dp


def test_steady_steps_keep_the_replicas_and_every_step_sees_the_new_weights():
    (kept, kept_dp), (fresh, fresh_dp) = twins(mlp)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (kept, fresh)]
    x = torch.randn(6, 4, dtype=torch.float64)
    for _ in range(4):
        assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))
        for optimizer in optimizers:
            optimizer.step()
    assert kept_dp.replica_cache.builds == len(DEVICES)
    assert_close_to_scale(list(kept.parameters()), list(fresh.parameters()), what="weights")


def new_parameter(model):
    model[0].weight = nn.Parameter(model[0].weight.detach() * 2)


def new_submodule(model):
    model.append(nn.Linear(4, 4).double())


def removed_submodule(model):
    del model[2]


def swapped_submodule(model):
    model[1] = nn.Sigmoid()


def changed_class(model):
    model[1].__class__ = nn.Sigmoid


def new_forward(model):
    model[1].forward = types.MethodType(lambda self, x: torch.sigmoid(x) * 3, model[1])


def frozen(model):
    model[0].weight.requires_grad_(False)


def forward_hook(model):
    model[0].register_forward_hook(lambda module, args, out: out * 3)


def forward_pre_hook(model):
    model[2].register_forward_pre_hook(lambda module, args: (args[0] + 1,))


def full_backward_hook(model):
    model[2].register_full_backward_hook(lambda module, grad_input, grad_output: (grad_input[0] * 5,))


def parametrized(model):
    class Symmetric(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).transpose(0, 1)

    parametrize.register_parametrization(model[2], "weight", Symmetric())


def weight_normed(model):
    torch.nn.utils.parametrizations.weight_norm(model[0])


def old_weight_norm(model):
    with pytest.warns(FutureWarning):
        torch.nn.utils.weight_norm(model[0])


def spectral_normed(model):
    torch.nn.utils.parametrizations.spectral_norm(model[2])


def old_spectral_norm(model):
    torch.nn.utils.spectral_norm(model[2])


def cast(model):
    model.float().double()  # new data in the same parameter objects, twice


@pytest.mark.parametrize(
    "change",
    [
        new_parameter,
        new_submodule,
        removed_submodule,
        swapped_submodule,
        changed_class,
        new_forward,
        forward_hook,
        forward_pre_hook,
        full_backward_hook,
        weight_normed,
        old_weight_norm,
        spectral_normed,
        old_spectral_norm,
    ],
)
def test_a_changed_module_gets_new_replicas(change):
    check_change(mlp, change)


def test_square_layers_for_the_parametrization():
    # parametrized() needs a square weight: model[2] is Linear(8, 4) in mlp(), so use 4 -> 4 -> 4 here
    def square():
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()

    check_change(square, parametrized)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda m: m.load_state_dict({k: v * 3 for k, v in m.state_dict().items()}), id="load_state_dict"),
        pytest.param(lambda m: torch.no_grad()(lambda: m[0].weight.mul_(-1))(), id="in-place"),
        pytest.param(frozen, id="requires_grad_"),
        pytest.param(cast, id="float-then-double"),
    ],
)
def test_new_values_in_the_same_tensors_keep_the_replicas(change):
    check_change(mlp, change, rebuilds=False)


def test_requires_grad_and_dtype_changes_give_new_tensors():
    kept, kept_dp = check_change(mlp, frozen, rebuilds=False)  # the tensors are made anew at every call
    assert kept[0].weight.grad is None and kept[2].weight.grad is not None
    kept.float()  # new data in the same parameter objects
    assert kept_dp(torch.randn(4, 4)).dtype == torch.float32
    assert kept_dp.replica_cache.builds == len(DEVICES)


def test_hook_removal_is_seen():
    (kept, kept_dp), (fresh, fresh_dp) = twins(mlp)
    x = torch.randn(6, 4, dtype=torch.float64)
    handles = [m[0].register_forward_hook(lambda module, args, out: out * 3) for m in (kept, fresh)]
    assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))
    for handle in handles:
        handle.remove()
    assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))
    # one removed and another added between two calls: as many hooks as before, not the same ones
    handles = [m[0].register_forward_hook(lambda module, args, out: out * 3) for m in (kept, fresh)]
    assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))
    for handle in handles:
        handle.remove()
    for m in (kept, fresh):
        m[0].register_forward_hook(lambda module, args, out: out - 1)
    assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4).double()
        self.scale = 1.0

    def forward(self, x):
        return self.linear(x) * self.scale


def test_a_plain_attribute_of_the_user_module_is_seen():
    check_change(Scaled, lambda m: setattr(m, "scale", 2.5))


def test_a_new_buffer_is_seen():
    class Offset(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4).double()

        def forward(self, x):
            out = self.linear(x)
            return out + self.offset if hasattr(self, "offset") else out

    check_change(Offset, lambda m: m.register_buffer("offset", torch.full((4,), 0.5, dtype=torch.float64)))


def test_train_and_eval_are_seen():
    def with_norm():
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).double()

    (kept, kept_dp), (fresh, fresh_dp) = twins(with_norm)
    x = torch.randn(6, 4, dtype=torch.float64)
    for mode in (True, False, True, False):
        kept.train(mode)
        fresh.train(mode)
        assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))
        for a, b in zip(kept.buffers(), fresh.buffers()):  # running statistics: updated once, by replica 0
            assert torch.equal(a, b)


def test_tied_weights_stay_tied_in_kept_replicas():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.encode = nn.Linear(4, 4, bias=False).double()
            self.decode = nn.Linear(4, 4, bias=False).double()
            self.decode.weight = self.encode.weight

        def forward(self, x):
            assert self.decode.weight is self.encode.weight
            return self.decode(torch.tanh(self.encode(x)))

    (kept, kept_dp), (fresh, fresh_dp) = twins(Tied)
    x = torch.randn(6, 4, dtype=torch.float64)
    for _ in range(3):
        assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))


def test_frozen_and_trainable_parameters_together():
    def partly_frozen():
        model = mlp()
        model[2].bias.requires_grad_(False)
        return model

    (kept, kept_dp), (fresh, fresh_dp) = twins(partly_frozen)
    x = torch.randn(6, 4, dtype=torch.float64)
    for _ in range(2):
        assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))
    assert kept[2].bias.grad is None and kept[2].weight.grad is not None


class SetsAttributes(nn.Module):
    """Counts its calls on itself and keeps a cache: a new replica at every call sees neither."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4).double()

    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        self.training = False  # even a flag nn.Module owns
        self.linear.cache = x
        return self.linear(x) * self.calls


def test_what_a_forward_sets_on_a_replica_is_gone_at_the_next_call():
    (kept, kept_dp), (fresh, fresh_dp) = twins(SetsAttributes)
    x = torch.randn(6, 4, dtype=torch.float64)
    for _ in range(3):
        assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))
    assert kept.training and not hasattr(kept, "calls") and not hasattr(kept.linear, "cache")
    assert kept_dp.replica_cache.builds == len(DEVICES)  # attributes are reset without a rebuild


class InstallsHooksLazily(nn.Module):
    """Like transformers' output capturing: hooks installed on the first forward, a flag set once."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4).double() for _ in range(2))

    def forward(self, x):
        if not getattr(self, "hooks_installed", False):
            self.captured = []
            for layer in self.layers:
                layer.register_forward_hook(lambda mod, args, out: self.captured.append(out))
            self.hooks_installed = True
        for layer in self.layers:
            x = layer(x)
        return x * len(self.captured)


def test_hooks_a_forward_registers_on_a_replica_do_not_reach_the_next_call():
    (kept, kept_dp), (fresh, fresh_dp) = twins(InstallsHooksLazily)
    x = torch.randn(6, 4, dtype=torch.float64)
    for _ in range(3):
        assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))
    assert all(len(layer._forward_hooks) == 0 for layer in kept.layers)


class ReplacesItsChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4).double()
        self.child = nn.Tanh()

    def forward(self, x):
        out = self.child(self.linear(x))
        self.child = nn.Identity()  # on the replica only
        self.register_buffer("seen", torch.ones(1, dtype=torch.float64))
        return out


def test_children_and_buffers_a_forward_changes_on_a_replica_do_not_reach_the_next_call():
    (kept, kept_dp), (fresh, fresh_dp) = twins(ReplacesItsChild)
    x = torch.randn(6, 4, dtype=torch.float64)
    for _ in range(3):
        assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))
    assert isinstance(kept.child, nn.Tanh) and not hasattr(kept, "seen")


def test_no_grad_and_inference_mode_calls_between_training_calls():
    (kept, kept_dp), (fresh, fresh_dp) = twins(mlp)
    x = torch.randn(6, 4, dtype=torch.float64)
    for context in (torch.no_grad, torch.inference_mode, torch.enable_grad, torch.no_grad, torch.enable_grad):
        with context():
            assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))
    assert all(p.grad is not None for p in kept.parameters())


def test_a_replaced_wrapped_module_is_replicated():
    (kept, kept_dp), _ = twins(mlp)
    x = torch.randn(6, 4, dtype=torch.float64)
    kept_dp(x)
    other = mlp()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(3)
    kept_dp.module = other
    assert torch.allclose(kept_dp(x), other(x), atol=1e-12)


def test_a_call_while_another_holds_the_cache_builds_fresh_replicas():
    (kept, kept_dp), (fresh, fresh_dp) = twins(mlp)
    x = torch.randn(6, 4, dtype=torch.float64)
    cache = kept_dp.replica_cache
    assert cache.acquire()
    try:  # as a second thread's call, or a forward calling its own wrapper, would find it
        assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))
        assert not cache.acquire()
    finally:
        cache.release()
    assert cache.builds == 0
    assert_same(run(kept, kept_dp, x), run(fresh, fresh_dp, x))
    assert cache.builds == len(DEVICES)


def test_copies_and_pickles_get_a_cache_of_their_own_module():
    (kept, kept_dp), _ = twins(mlp)
    x = torch.randn(6, 4, dtype=torch.float64)
    kept_dp(x)
    for other in (copy.deepcopy(kept_dp), pickle.loads(pickle.dumps(kept_dp))):
        assert other.replica_cache.module is other.module and other.module is not kept
        assert torch.allclose(other(x), kept_dp(x), atol=1e-12)


def test_rnn_replicas_point_at_this_calls_weights():
    def gru():
        return nn.GRU(4, 5, batch_first=True).double()

    (kept, kept_dp), (fresh, fresh_dp) = twins(gru)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (kept, fresh)]
    x = torch.randn(4, 3, 4, dtype=torch.float64)
    for _ in range(3):
        for dp, optimizer in ((kept_dp, optimizers[0]), (fresh_dp, optimizers[1])):
            optimizer.zero_grad()
            dp(x)[0].square().sum().backward()
            optimizer.step()
        assert_close_to_scale(list(kept.parameters()), list(fresh.parameters()), what="weights")


def test_sparse_gradients_and_unused_parameters_through_kept_replicas():
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(10, 4, sparse=True).double()
            self.unused = nn.Linear(4, 4).double()

        def forward(self, ids):
            return self.embedding(ids)

    (kept, kept_dp), (fresh, fresh_dp) = twins(Bag)
    ids = torch.tensor([[1, 2], [3, 4], [1, 5], [6, 1]])
    for _ in range(2):
        for model, dp in ((kept, kept_dp), (fresh, fresh_dp)):
            model.zero_grad(set_to_none=True)
            dp(ids).sum().backward()
        assert kept.embedding.weight.grad.is_sparse
        assert torch.equal(kept.embedding.weight.grad.to_dense(), fresh.embedding.weight.grad.to_dense())
        assert kept.unused.weight.grad is None and fresh.unused.weight.grad is None


def test_double_backward_through_kept_replicas():
    (kept, kept_dp), (fresh, fresh_dp) = twins(mlp)
    x = torch.randn(6, 4, dtype=torch.float64)
    results = []
    for model, dp in ((kept, kept_dp), (fresh, fresh_dp)):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            out = dp(x).square().sum()
            (grad,) = torch.autograd.grad(out, model[0].weight, create_graph=True)
            grad.square().sum().backward()
        results.append([p.grad.clone() for p in model.parameters()])
    assert_close_to_scale(*results, what="gradients")


def test_a_loss_over_two_forwards_before_one_backward():
    (kept, kept_dp), (fresh, fresh_dp) = twins(mlp)
    x, z = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    grads = []
    for model, dp in ((kept, kept_dp), (fresh, fresh_dp)):
        (dp(x).square().sum() + F.mse_loss(dp(z), dp(x))).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert_close_to_scale(*grads, what="gradients")


@pytest.mark.parametrize("cache_replicas", ["yes", None])
def test_cache_replicas_must_be_a_bool(cache_replicas):
    with pytest.raises(TypeError, match="cache_replicas: expected True or False"):
        DataParallel(mlp(), DEVICES, cache_replicas=cache_replicas)
