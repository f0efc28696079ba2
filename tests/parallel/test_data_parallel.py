"""DataParallel on virtual CPU devices: the rules of the foundation issue, each with a test that fails if it breaks."""

import copy
import threading
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpkit
from closeness import assert_close_to_scale
from dpkit import Broadcast, DataParallel


def make_mlp(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def grads_of(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_grads_close(a, b):
    """Within float64 rounding of the gradients' size: the replicas' sum against one device's whole batch."""
    assert_close_to_scale(a, b, what="gradients")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [4, 7, 13])
def test_gradients_equal_single_device(n, batch):
    single = make_mlp()
    model = copy.deepcopy(single)
    x = torch.randn(batch, 6, dtype=torch.float64)
    y = torch.randint(0, 4, (batch,))
    F.cross_entropy(single(x), y).backward()
    dp = DataParallel(model, dpkit.cpu_devices(n))
    out = dp(x)
    assert dp.last_split_sizes == dpkit.split_sizes(batch, n)
    assert_close_to_scale(out, single(x), what="outputs")  # chunks against the whole batch: rounding apart
    F.cross_entropy(out, y).backward()
    assert_grads_close(grads_of(model), grads_of(single))


@pytest.mark.parametrize("chunk_sizes", [[1, 9], [5, 0, 5], [0, 10], [2, 3, 1, 4]])
def test_gradients_equal_with_explicit_uneven_chunks(chunk_sizes):
    single = make_mlp()
    model = copy.deepcopy(single)
    x = torch.randn(10, 6, dtype=torch.float64)
    single(x).pow(2).mean().backward()
    dp = DataParallel(model, dpkit.cpu_devices(len(chunk_sizes)), chunk_sizes=chunk_sizes)
    dp(x).pow(2).mean().backward()
    assert dp.last_split_sizes == chunk_sizes
    assert_grads_close(grads_of(model), grads_of(single))


class CountingReplicas(nn.Module):
    """Records which module objects and threads ran, to observe replication."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.calls = []
        self.lock = threading.Lock()

    def forward(self, x):
        with self.lock:
            self.calls.append((id(self), threading.current_thread().name, x.shape[0]))
        return self.linear(x)


def test_zero_chunk_creates_no_replica_there():
    module = CountingReplicas()
    dp = DataParallel(module, dpkit.cpu_devices(3), chunk_sizes=[0, 4, 0])
    dp(torch.randn(4, 2))
    assert len(module.calls) == 1
    replica_id, _, rows = module.calls[0]
    assert rows == 4 and replica_id != id(module)  # a copy for cpu:1, none for cpu:0 or cpu:2


def test_one_worker_thread_per_device_and_every_replica_is_a_replica():
    module = CountingReplicas()
    dp = DataParallel(module, dpkit.cpu_devices(3), concurrency="threads")  # (auto's second call runs serially)
    dp(torch.randn(7, 2))
    dp(torch.randn(7, 2))
    threads = sorted({thread for _, thread, _ in module.calls})
    assert len(threads) == 3 and all(t.startswith("dpkit-cpu:") for t in threads)
    # every replica is a replica, the primary's included (as in torch): the user's module never runs itself
    ids = {thread.split("_")[0]: i for i, thread, _ in module.calls}
    assert id(module) not in ids.values() and len(set(ids.values())) == 3


def test_wrapper_parameters_are_the_module_parameters_and_state_dict_has_prefix():
    model = make_mlp()
    dp = DataParallel(model, dpkit.cpu_devices(2))
    assert [id(p) for p in dp.parameters()] == [id(p) for p in model.parameters()]
    assert dp.module is model
    assert all(key.startswith("module.") for key in dp.state_dict())
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
    before = model[0].weight.clone()
    dp(torch.randn(5, 6, dtype=torch.float64)).sum().backward()
    optimizer.step()
    assert not torch.equal(before, model[0].weight)


Pair = namedtuple("Pair", "a b")


@dataclass
class Features:
    values: torch.Tensor
    note: str


class NestedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3).double()

    def forward(self, pair, features, *, scale, mask=None, tag="t"):
        out = self.linear(pair.a) * scale + pair.b + features.values
        if mask is not None:
            out = out * mask
        return {"out": out, "pair": Pair(out.sum(1, keepdim=True), tag), "none": None}


def test_nested_inputs_kwargs_and_outputs():
    torch.manual_seed(1)
    model = NestedModel()
    single = copy.deepcopy(model)
    a, b, v = (torch.randn(9, 3, dtype=torch.float64) for _ in range(3))
    mask = (torch.rand(9, 1) > 0.3).double()
    scale = torch.tensor(2.0, dtype=torch.float64)
    dp = DataParallel(model, dpkit.cpu_devices(4))
    out = dp(Pair(a, b), Features(v, "n"), scale=Broadcast(scale), mask=mask, tag="x")
    ref = single(Pair(a, b), Features(v, "n"), scale=scale, mask=mask, tag="x")
    assert list(out) == ["out", "pair", "none"]
    assert torch.allclose(out["out"], ref["out"])
    assert isinstance(out["pair"], Pair) and out["pair"].b == ["x"] * 4
    assert out["none"] is None
    out["out"].sum().backward()
    ref["out"].sum().backward()
    assert_grads_close(grads_of(model), grads_of(single))


def test_mismatched_kwarg_batch_is_an_error_naming_it():
    dp = DataParallel(NestedModel(), dpkit.cpu_devices(2))
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"kwargs\['mask'\]=3"):
        dp(Pair(x, x), Features(x, "n"), scale=Broadcast(torch.tensor(1.0)), mask=torch.ones(3, 1))
    with pytest.raises(ValueError, match=r"kwargs\['scale'\].*Broadcast"):
        dp(Pair(x, x), Features(x, "n"), scale=torch.tensor(1.0))


def test_batch_smaller_than_device_count_uses_as_many_devices_as_rows():
    module = CountingReplicas()
    dp = DataParallel(module, dpkit.cpu_devices(4))
    out = dp(torch.randn(2, 2))
    assert out.shape == (2, 2) and dp.last_split_sizes == [1, 1, 0, 0]
    assert len(module.calls) == 2


class NoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.ones(3))

    def forward(self, scale=1.0, extra=None):
        out = self.p * scale
        return out if extra is None else out + extra


def test_nothing_to_split_runs_once_on_primary():
    module = NoInputs()
    dp = DataParallel(module, dpkit.cpu_devices(3))
    out = dp(scale=2.0, extra=Broadcast(torch.ones(3)))
    assert torch.equal(out, torch.full((3,), 3.0)) and dp.last_split_sizes is None


def test_empty_batch_is_an_error():
    dp = DataParallel(make_mlp(), dpkit.cpu_devices(2))
    with pytest.raises(ValueError, match="empty batch"):
        dp(torch.zeros(0, 6, dtype=torch.float64))


def test_construction_errors():
    with pytest.raises(ValueError, match="empty"):
        DataParallel(make_mlp(), [])
    with pytest.raises(ValueError, match="twice"):
        DataParallel(make_mlp(), ["cpu:1", "cpu:1"])
    with pytest.raises(ValueError, match="mixed"):
        DataParallel(make_mlp(), ["cpu:0", "cuda:0"])
    with pytest.raises(ValueError, match="chunk_sizes"):
        DataParallel(make_mlp(), dpkit.cpu_devices(2), chunk_sizes=[1, 2, 3])
    with pytest.raises(ValueError, match=r"chunk_sizes\[1\]"):
        DataParallel(make_mlp(), dpkit.cpu_devices(2), chunk_sizes=[1, -2])
    with pytest.raises(TypeError, match="module"):
        DataParallel("model", dpkit.cpu_devices(2))


def test_chunk_sizes_that_do_not_sum_to_the_batch():
    dp = DataParallel(make_mlp(), dpkit.cpu_devices(2), chunk_sizes=[3, 3])
    with pytest.raises(ValueError, match="sum to 6 but the batch has 7"):
        dp(torch.randn(7, 6, dtype=torch.float64))


@pytest.mark.cuda
def test_parameter_off_primary_gpu_is_named():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    model = make_mlp().cuda(1)
    with pytest.raises(RuntimeError, match="parameter '0.weight' is on cuda:1.*cuda:0"):
        DataParallel(model, [0, 1])(torch.randn(2, 6, dtype=torch.float64, device="cuda:0"))


def test_parameter_off_primary_device_is_named_before_any_replica_runs():
    module = CountingReplicas()
    module.linear.bias = nn.Parameter(torch.zeros(2, device="meta"))
    dp = DataParallel(module, dpkit.cpu_devices(2))
    with pytest.raises(RuntimeError, match="parameter 'linear.bias' is on meta.*cpu:0"):
        dp(torch.randn(4, 2))
    assert module.calls == []


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3).double()

    def forward(self, x):
        return self.bn(x)


def test_batchnorm_running_stats_follow_the_primary_replica():
    model = WithBatchNorm()
    dp = DataParallel(model, dpkit.cpu_devices(2))
    x = torch.randn(8, 3, dtype=torch.float64)
    dp(x)
    reference = nn.BatchNorm1d(3).double()
    reference(x[:4])  # the primary replica saw the first chunk
    assert torch.allclose(model.bn.running_mean, reference.running_mean)
    assert torch.allclose(model.bn.running_var, reference.running_var)
    assert model.bn.num_batches_tracked.item() == 1


def test_train_and_eval_propagate():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    dp = DataParallel(model, dpkit.cpu_devices(2))
    x = torch.ones(6, 4)
    dp.eval()
    assert not model.training and torch.allclose(dp(x), model(x), atol=1e-6)
    dp.train()
    assert model.training
    assert (dp(x) == 0).any()


class Probe(nn.Module):
    """Calls `record()` in every replica's thread and keeps what it returns."""

    def __init__(self, record):
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.record = record
        self.seen = []

    def forward(self, x):
        self.seen.append(self.record())
        return self.linear(x)


def test_no_grad_and_inference_mode_reach_the_replicas():
    probe = Probe(lambda: (torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
    seen = probe.seen
    dp = DataParallel(probe, dpkit.cpu_devices(2))
    with torch.no_grad():
        out = dp(torch.randn(4, 2))
    assert seen == [(False, False)] * 2 and not out.requires_grad
    seen.clear()
    with torch.inference_mode():
        out = dp(torch.randn(4, 2))
    assert seen == [(False, True)] * 2 and out.is_inference()
    seen.clear()
    assert dp(torch.randn(4, 2)).requires_grad and seen == [(True, False)] * 2


def test_autocast_state_and_dtype_reach_the_replicas():
    probe = Probe(lambda: (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
    seen = probe.seen
    dp = DataParallel(probe, dpkit.cpu_devices(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dp(torch.randn(4, 2))
    assert seen == [(True, torch.bfloat16)] * 2 and out.dtype == torch.bfloat16


def test_forward_hooks_fire_once_per_replica():
    model = make_mlp()
    fired = []
    model.register_forward_hook(lambda module, inputs, output: fired.append(inputs[0].shape[0]))
    DataParallel(model, dpkit.cpu_devices(3))(torch.randn(8, 6, dtype=torch.float64))
    assert sorted(fired) == [2, 3, 3]


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(3, 3).double()
        self.frozen = nn.Linear(3, 3).double()
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(3, 3).double()

    def forward(self, x):
        return self.used(self.frozen(x))


def test_unused_and_frozen_parameters_keep_no_grad():
    model = Unused()
    DataParallel(model, dpkit.cpu_devices(3))(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
    assert model.used.weight.grad is not None
    assert model.frozen.weight.grad is None and model.unused.weight.grad is None


def test_double_backward_matches_single_device():
    single = make_mlp()
    model = copy.deepcopy(single)
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)

    def gradient_penalty(net):
        out = net(x).pow(2).sum()
        (gx,) = torch.autograd.grad(out, x, create_graph=True)
        return gx.pow(2).sum()

    gradient_penalty(single).backward()
    gradient_penalty(DataParallel(model, dpkit.cpu_devices(3))).backward()
    assert_grads_close(grads_of(model), grads_of(single))


def test_sparse_gradients_sum_onto_the_primary():
    torch.manual_seed(0)
    single = nn.Embedding(10, 3, sparse=True).double()
    model = copy.deepcopy(single)
    idx = torch.tensor([1, 2, 2, 5, 9, 1, 0])
    single(idx).pow(2).sum().backward()
    DataParallel(model, dpkit.cpu_devices(3))(idx).pow(2).sum().backward()
    assert model.weight.grad.is_sparse
    assert torch.allclose(model.weight.grad.to_dense(), single.weight.grad.to_dense())


class Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x):
        if x.shape[0] == 1:
            raise KeyError("boom")
        return self.linear(x)


def test_replica_errors_carry_type_replica_and_device_and_the_wrapper_survives():
    dp = DataParallel(Fails(), dpkit.cpu_devices(3))
    with pytest.raises(KeyError, match="replica 2 on device cpu:2") as info:
        dp(torch.randn(5, 2))  # 2, 2, 1 rows: the last replica fails
    assert isinstance(info.value.__cause__, KeyError)
    assert dp(torch.randn(6, 2)).shape == (6, 2)


def test_errors_that_cannot_be_rebuilt_become_runtime_errors():
    class Custom(Exception):
        def __init__(self, a, b):
            super().__init__(a, b)

    class Raises(nn.Module):
        def forward(self, x):
            raise Custom(1, 2)

    with pytest.raises(RuntimeError, match="replica 0 on device cpu:0"):
        DataParallel(Raises(), dpkit.cpu_devices(2))(torch.randn(4, 2))


def run_dropout_step(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 2))
    dp = DataParallel(model, dpkit.cpu_devices(4))
    x = torch.randn(13, 8)
    out = dp(x)
    out.pow(2).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def test_same_seed_gives_bitwise_identical_outputs_and_gradients_with_dropout():
    out_a, grads_a = run_dropout_step(3)
    for _ in range(3):
        out_b, grads_b = run_dropout_step(3)
        assert torch.equal(out_a, out_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    out_c, _ = run_dropout_step(4)
    assert not torch.equal(out_a, out_c)


def test_zero_dim_output_is_a_vector_per_replica_with_a_warning():
    class ScalarOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 1)

        def forward(self, x):
            return self.linear(x).sum()

    dp = DataParallel(ScalarOut(), dpkit.cpu_devices(3))
    with pytest.warns(UserWarning, match="0-dim"):
        out = dp(torch.randn(7, 2))
    assert out.shape == (3,)


def test_gather_on_another_output_device_and_dim():
    model = nn.Linear(3, 2)
    dp = DataParallel(model, dpkit.cpu_devices(2), output_device="cpu:1", dim=1)
    x = torch.randn(3, 5, 3)
    out = dp(x)
    assert out.shape == (3, 5, 2) and dp.last_split_sizes == [3, 2]
    assert torch.allclose(out, model(x), atol=1e-6)


def test_virtual_devices_share_the_intra_op_threads_fairly():
    from dpkit.devices import cpu_threads_per_device

    probe = Probe(lambda: torch.get_num_threads())
    seen = probe.seen
    main_threads = torch.get_num_threads()
    DataParallel(probe, dpkit.cpu_devices(2))(torch.randn(4, 2))
    assert seen == [cpu_threads_per_device(2)] * 2
    assert torch.get_num_threads() == main_threads  # the caller's own setting is untouched


def test_negative_dim_equals_its_positive_twin():
    torch.manual_seed(0)
    module = nn.Linear(4, 3)
    x = torch.randn(5, 6, 4)  # batch along dim 1 of 3
    dp_neg = DataParallel(module, device_ids=["cpu:0", "cpu:1"], dim=-2)
    dp_pos = DataParallel(module, device_ids=["cpu:0", "cpu:1"], dim=1)
    assert torch.equal(dp_neg(x), dp_pos(x))
    assert torch.allclose(dp_neg(x), module(x), atol=1e-6)


def test_compiled_module_refused_at_construction_and_left_unchanged():
    module = nn.Linear(3, 2)
    compiled = torch.compile(module)
    before = dict(module._modules)
    with pytest.raises(TypeError, match="compile"):
        DataParallel(compiled, device_ids=["cpu:0", "cpu:1"])
    assert module._modules == before
    assert module(torch.ones(1, 3)).shape == (1, 2)
