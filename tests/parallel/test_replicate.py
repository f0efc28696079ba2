import threading

import pytest
import torch
from torch import nn

from dpkit.parallel import replicate
from dpkit.parallel.replicate import check_replicable, replicate_to

CPU0, CPU1 = torch.device("cpu", 0), torch.device("cpu", 1)


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = self.a  # the same submodule twice
        self.register_buffer("steps", torch.zeros(1))


def test_every_replica_is_a_replica_and_the_first_aliases_the_originals():
    module = Shared()
    replicas = replicate(module, [CPU0, CPU1])
    assert all(r is not module and isinstance(r, Shared) for r in replicas)
    first, second = replicas
    assert first.a is first.b and second.a is second.b  # sharing kept
    # the source device's replica: non-leaf aliases of the parameters, the buffers themselves
    assert first.a.weight is not module.a.weight and not first.a.weight.is_leaf
    assert first.a.weight.data_ptr() == module.a.weight.data_ptr()
    assert first.steps is module.steps
    # another device: copies
    assert second.a.weight.data_ptr() != module.a.weight.data_ptr() and torch.equal(second.a.weight, module.a.weight)
    assert second.steps.data_ptr() != module.steps.data_ptr()


def test_replica_gradients_flow_back_to_the_original_parameters():
    module = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    expected = torch.autograd.grad(module(x).sum(), module.weight)[0]
    for replica in replicate(module, [CPU0, CPU1]):
        module.weight.grad = None
        replica(x).sum().backward()
        assert torch.allclose(module.weight.grad, expected)


def test_first_replica_buffer_updates_persist_and_the_others_do_not():
    module = nn.BatchNorm1d(2)
    first, second = replicate(module, [CPU0, CPU1])
    second(torch.randn(6, 2))
    assert torch.equal(module.running_mean, torch.zeros(2)) and not torch.equal(second.running_mean, torch.zeros(2))
    first(torch.randn(6, 2) + 3)
    assert (module.running_mean > 0.1).all() and int(module.num_batches_tracked) == 1


def test_rnn_replicas_run_on_their_own_weights_and_match():
    rnn = nn.GRU(4, 5, batch_first=True)
    x = torch.randn(2, 3, 4)
    for replica in replicate(rnn, [CPU0, CPU1]):
        assert all(w is replica._parameters[n] for w, n in zip(replica._flat_weights, replica._flat_weights_names))
        assert torch.allclose(replica(x)[0], rnn(x)[0])
        replica(x)[0].sum().backward()
    assert rnn.weight_ih_l0.grad is not None


def test_detach_and_no_grad_make_no_graph():
    module = nn.Linear(2, 2)
    assert all(not r.weight.requires_grad for r in replicate(module, [CPU0, CPU1], detach=True))
    with torch.no_grad():
        copy = replicate_to(module, CPU1)
    assert not copy.weight.requires_grad


class ReadsItsParameters(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        first = next(self.parameters())
        names = [name for name, _ in self.named_parameters()]
        assert names == ["linear.weight", "linear.bias"]
        return self.linear(x.to(first.dtype)) * len(list(self.parameters()))


def test_parameters_are_visible_inside_every_replica():
    module = ReadsItsParameters()
    x = torch.randn(4, 3)
    for replica in replicate(module, [CPU0, CPU1]):
        assert [p.data_ptr() for p in replica.parameters()] == [
            replica.linear.weight.data_ptr(),
            replica.linear.bias.data_ptr(),
        ]
        assert torch.allclose(replica(x), module(x))


class ZeroesGradAndSetsAttributes(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x):
        self.zero_grad()
        self.seen = x.shape[0]  # an attribute set in forward
        self.linear.flag = True  # and on a child
        return self.linear(x)


def test_zero_grad_in_a_replica_warns_and_leaves_the_users_gradients():
    module = ZeroesGradAndSetsAttributes()
    module.linear.weight.grad = torch.ones(2, 2)
    for replica in replicate(module, [CPU0, CPU1]):
        with pytest.warns(UserWarning, match="zero_grad"):
            replica(torch.randn(3, 2))
    assert torch.equal(module.linear.weight.grad, torch.ones(2, 2))
    assert not hasattr(module, "seen") and not hasattr(module.linear, "flag")


class InstallsHooksLazily(nn.Module):
    """Like transformers' output capturing: hooks installed on the first forward, a flag set once."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    def forward(self, x):
        if not getattr(self, "hooks_installed", False):
            self.captured = []
            for layer in self.layers:
                layer.register_forward_hook(lambda mod, args, out: self.captured.append(out))
            self.hooks_installed = True
        for layer in self.layers:
            x = layer(x)
        return x, len(self.captured)


def test_hooks_installed_in_a_replica_stay_in_the_replica():
    module = InstallsHooksLazily()
    x = torch.randn(4, 2)
    for _ in range(3):
        for replica in replicate(module, [CPU0, CPU1]):
            _, captured = replica(x)
            assert captured == 2
    assert all(len(layer._forward_hooks) == 0 for layer in module.layers)
    assert not hasattr(module, "hooks_installed")
    out, captured = module(x)
    assert captured == 2 and len(module.layers[0]._forward_hooks) == 1


def test_hooks_of_the_original_run_in_replicas():
    module = nn.Linear(2, 2)
    seen = []
    lock = threading.Lock()

    def record(mod, args, out):
        with lock:
            seen.append(mod)

    module.register_forward_hook(record)
    replicas = replicate(module, [CPU0, CPU1])
    for replica in replicas:
        replica(torch.randn(1, 2))
    assert seen == replicas and len(module._forward_hooks) == 1


def test_torch_compiled_module_is_refused_and_left_unchanged():
    model = nn.Linear(2, 2)
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(TypeError, match="torch.compile.*uncompiled"):
        replicate(compiled, [CPU0, CPU1])
    with pytest.raises(TypeError, match="torch.compile"):
        check_replicable(nn.Sequential(compiled))
    assert list(model._modules) == [] and [n for n, _ in model.named_parameters()] == ["weight", "bias"]
    model.compile(backend="eager")
    with pytest.raises(TypeError, match=r"\.compile\(\)"):
        check_replicable(model)


def test_lazy_modules_are_refused_until_initialised():
    with pytest.raises(RuntimeError, match="uninitialized parameters"):
        replicate(nn.LazyLinear(2), [CPU0])


def test_device_specs_and_bad_detach():
    module = nn.Linear(2, 2)
    assert len(replicate(module, ["cpu:0", torch.device("cpu", 1)])) == 2
    assert replicate(module, []) == []
    with pytest.raises(TypeError, match="detach"):
        replicate(module, [CPU0], detach="yes")
