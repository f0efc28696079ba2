"""loss_fn inside the replicas: weighted by batch share, equal to single-device loss and gradients."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpkit


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5)).double()


def data(rows=8):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 6, generator=generator, dtype=torch.float64), torch.randint(
        0, 5, (rows,), generator=generator
    )


def single_device(model, x, y, reduction):
    reference = copy.deepcopy(model)
    loss = F.cross_entropy(reference(x), y, reduction=reduction)
    loss.backward()
    return loss.detach(), [p.grad for p in reference.parameters()]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_sizes", [[1, 5, 2], [6, 0, 2], [2, 3, 3]])
def test_loss_and_every_gradient_equal_single_device(reduction, chunk_sizes):
    model = make_model()
    x, y = data()
    expected_loss, expected_grads = single_device(model, x, y, reduction)
    criterion = lambda out, target: F.cross_entropy(out, target, reduction=reduction)  # noqa: E731
    dp = dpkit.DataParallel(
        model, dpkit.cpu_devices(3), chunk_sizes=chunk_sizes, loss_fn=criterion, loss_reduction=reduction
    )
    loss = dp(x, target=y)
    assert loss.dim() == 0
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=1e-13, atol=1e-13)
    for param, grad in zip(model.parameters(), expected_grads):
        torch.testing.assert_close(param.grad, grad, rtol=1e-12, atol=1e-13)


def test_unweighted_mean_of_replica_losses_would_be_wrong_on_this_split():
    model = make_model()
    x, y = data()
    sizes = [1, 5, 2]
    expected_loss, _ = single_device(model, x, y, "mean")
    with torch.no_grad():
        offsets = [0, 1, 6]
        per_replica = [F.cross_entropy(model(x[o : o + n]), y[o : o + n]) for o, n in zip(offsets, sizes)]
    unweighted = torch.stack(per_replica).mean()
    assert abs(unweighted - expected_loss) > 1e-3  # the split is uneven enough to matter
    dp = dpkit.DataParallel(model, dpkit.cpu_devices(3), chunk_sizes=sizes, loss_fn=F.cross_entropy)
    torch.testing.assert_close(dp(x, target=y).detach(), expected_loss, rtol=1e-13, atol=1e-13)


def test_only_a_scalar_per_replica_reaches_the_output_device():
    model = make_model()
    x, y = data()
    dp = dpkit.DataParallel(model, dpkit.cpu_devices(2), loss_fn=F.cross_entropy)
    loss = dp(x, target=y)
    assert loss.shape == ()
    # without target= the same wrapper returns the gathered outputs
    assert dp(x).shape == (8, 5)


def test_target_goes_to_the_module_when_there_is_no_loss_fn():
    class WithTarget(nn.Module):
        def forward(self, x, target):
            return x * 0 + target

    dp = dpkit.DataParallel(WithTarget(), dpkit.cpu_devices(2))
    x = torch.zeros(4, 1)
    target = torch.arange(4.0).unsqueeze(1)
    torch.testing.assert_close(dp(x, target=target), target)


def test_loss_fn_must_return_a_scalar():
    dp = dpkit.DataParallel(
        make_model(), dpkit.cpu_devices(2), loss_fn=lambda out, t: F.cross_entropy(out, t, reduction="none")
    )
    x, y = data()
    with pytest.raises(ValueError, match="loss_fn: must return a 0-dim tensor"):
        dp(x, target=y)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="loss_reduction"):
        dpkit.DataParallel(make_model(), dpkit.cpu_devices(2), loss_fn=F.cross_entropy, loss_reduction="avg")
    with pytest.raises(TypeError, match="loss_fn"):
        dpkit.DataParallel(make_model(), dpkit.cpu_devices(2), loss_fn="cross_entropy")
    x, y = data()
    dp = dpkit.DataParallel(make_model(), dpkit.cpu_devices(2), loss_fn=F.cross_entropy)
    with pytest.raises(ValueError, match="batch size"):
        dp(x, target=y[:5])
