"""torch.nn.parallel's functional verbs from dpkit.parallel, with torch's signatures."""

import copy

import pytest
import torch
from torch import nn

import dpkit.parallel as dp
from closeness import assert_close_to_scale
from dpkit.parallel import apply

DEVICES = ["cpu:0", "cpu:1"]


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x, scale=1.0, bias=None):
        out = self.bn(self.linear(x)) * scale
        return out if bias is None else out + bias


def test_data_parallel_matches_a_single_device_run_in_outputs_gradients_and_buffers():
    model = Scaled()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4)
    bias = torch.randn(8, 3)
    out = dp.data_parallel(model, (x, 2.0), DEVICES, module_kwargs={"bias": bias})
    expected = torch.cat([reference(x[:4], 2.0, bias[:4]), reference(x[4:], 2.0, bias[4:])])  # BatchNorm per chunk
    # the chunks' products run with a replica's thread count here and this thread's there: equal up to rounding
    assert_close_to_scale(out, expected, what="outputs")
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    # the replicas' gradients summed against one backward through both chunks; batch norm's backward over four
    # rows subtracts means of terms larger than the result (measured: up to 3.5e-6 with plain kernels)
    grads, expected_grads = [p.grad for p in model.parameters()], [q.grad for q in reference.parameters()]
    assert_close_to_scale(grads, expected_grads, 5e-5, "gradients")
    # the first device's replica updated the user's running statistics, once (as torch's does)
    assert int(model.bn.num_batches_tracked) == 1
    expected_mean = 0.9 * torch.zeros(3) + 0.1 * model.linear(x[:4]).mean(0)
    assert_close_to_scale(model.bn.running_mean, expected_mean, what="running mean")


def test_a_bare_tensor_is_one_argument_and_negative_dims_work():
    model = nn.Linear(6, 2)
    x = torch.randn(5, 6)
    assert torch.allclose(dp.data_parallel(model, x, DEVICES), model(x), atol=1e-6)
    xt = x.T.contiguous()  # the batch on the last dim
    out = dp.data_parallel(lambda_module(lambda t: t * 2), xt, DEVICES, dim=-1)
    assert torch.equal(out, xt * 2)


def lambda_module(fn):
    class Lambda(nn.Module):
        def forward(self, *args):
            return fn(*args)

    return Lambda()


def test_no_inputs_and_one_device_run_the_module_directly():
    model = lambda_module(lambda: torch.ones(2))
    assert torch.equal(dp.data_parallel(model, None, DEVICES), torch.ones(2))
    linear = nn.Linear(3, 3)
    x = torch.randn(4, 3)
    assert torch.equal(dp.data_parallel(linear, (x,), ["cpu:0"]), linear(x))


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="module: expected a torch.nn.Module"):
        dp.data_parallel("model", torch.ones(2), DEVICES)
    with pytest.raises(ValueError, match=r"inputs\[1\]=3"):
        dp.data_parallel(nn.Identity(), (torch.ones(4), torch.ones(3)), DEVICES)
    with pytest.raises(TypeError, match="dim: expected an int"):
        dp.data_parallel(nn.Identity(), torch.ones(4), DEVICES, dim="0")
    with pytest.raises(TypeError, match="torch.compile"):
        dp.data_parallel(torch.compile(nn.Linear(2, 2), backend="eager"), torch.ones(4, 2), DEVICES)


def test_verbs_compose_like_torchs():
    model = nn.Linear(4, 2)
    x = torch.randn(6, 4)
    parts = dp.scatter(x, DEVICES)
    replicas = dp.replicate(model, DEVICES)
    outputs = [replica(part) for replica, part in zip(replicas, parts)]
    assert torch.allclose(dp.gather(outputs, "cpu:0"), model(x), atol=1e-6)
    assert dp.parallel_apply is apply.parallel_apply
    assert set(dp.__all__) >= {"data_parallel", "replicate", "scatter", "gather", "parallel_apply", "DataParallel"}


def test_data_parallel_calls_the_runner_with_torchs_argument_order(monkeypatch):
    calls = []

    def torch_style(modules, inputs, kwargs_tup=None, devices=None):
        calls.append(devices)
        return [module(*args, **kw) for module, args, kw in zip(modules, inputs, kwargs_tup)]

    monkeypatch.setattr(apply, "parallel_apply", torch_style)
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    assert torch.allclose(dp.data_parallel(model, x, DEVICES), model(x), atol=1e-6)
    assert calls == [[torch.device("cpu", 0), torch.device("cpu", 1)]]
