"""A BatchNorm CNN converted with nn.SyncBatchNorm.convert_sync_batchnorm, trained under dp, dp-balanced and
replicated on virtual CPU devices, against a single-device run of the whole batch: the loss, every
gradient and the running statistics agree, uneven splits and a replica with no rows included."""

import copy
import threading

import pytest
import torch
from torch import nn

import dpkit
from closeness import assert_close_to_scale
from dpkit.parallel import sync_batchnorm

# relative to the values' size (tests/closeness.py): the replicas and one device sum the batch's rows in different
# orders, and the input's offset of 30 (below) makes the first convolution's weight gradient, and the statistics
# after it, sums of terms about ten times their size that cancel. Measured on AVX-512, AVX2 and plain kernels
# with 1 to 3 threads: up to 4e-6 for gradients, 7e-6 for running statistics after three steps; a statistic off by
# one row's share (a variance divided by n - 1 instead of n: 5e-3) or from a chunk instead of the batch is far out
TOLERANCE = 5e-5


def bn_cnn(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=None),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 8),
        nn.BatchNorm1d(8),
        nn.Linear(8, 3),
    )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def batch(rows, seed=1):
    generator = torch.Generator().manual_seed(seed)
    # a large offset: statistics computed as E[x²]-E[x]² would lose the variance here
    return torch.randn(rows, 3, 5, 5, generator=generator) * 2 + 30, torch.randint(0, 3, (rows,), generator=generator)


def assert_buffers_match(model, reference):
    """Every running statistic against its own size (running variances are in the tens, means below one)."""
    for (name, buffer), expected in zip(model.named_buffers(), reference.buffers()):
        assert_close_to_scale(buffer, expected, TOLERANCE, f"running statistic {name}")


def assert_matches_single_device(model, reference, loss, reference_loss):
    assert_close_to_scale(loss, reference_loss, TOLERANCE, "loss")
    # against the largest gradient: a convolution's bias followed by a batch norm has a gradient that cancels to
    # about zero, so its own size is rounding
    grads, reference_grads = [p.grad for p in model.parameters()], [p.grad for p in reference.parameters()]
    assert_close_to_scale(grads, reference_grads, TOLERANCE, "gradients")
    assert_buffers_match(model, reference)


def single_device_step(reference, x, y):
    loss = nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    return loss


@pytest.mark.parametrize("chunk_sizes", [None, [5, 2], [0, 7], [6, 1]])
def test_data_parallel_gives_whole_batch_loss_gradients_and_running_stats(chunk_sizes):
    model = bn_cnn()
    reference = copy.deepcopy(model)
    x, y = batch(7)
    dp = dpkit.DataParallel(model, dpkit.cpu_devices(2), chunk_sizes=chunk_sizes)
    loss = nn.functional.cross_entropy(dp(x), y)
    loss.backward()
    assert_matches_single_device(model, reference, loss, single_device_step(reference, x, y))


def test_three_devices_two_steps_then_eval_uses_the_synced_running_stats():
    model = bn_cnn()
    reference = copy.deepcopy(model)
    dp = dpkit.DataParallel(model, dpkit.cpu_devices(3))
    for step in range(2):
        x, y = batch(8, seed=step)
        loss = nn.functional.cross_entropy(dp(x), y)
        loss.backward()
        reference_loss = single_device_step(reference, x, y)
    assert_matches_single_device(model, reference, loss, reference_loss)
    model.eval(), reference.eval()
    x, _ = batch(5, seed=9)
    with torch.no_grad():
        assert_close_to_scale(dp(x), reference(x), TOLERANCE, "outputs in eval mode")


def test_plain_batchnorm_stays_per_chunk_as_in_torch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    x = torch.randn(8, 4) + 3
    chunks = dpkit.DataParallel(model, dpkit.cpu_devices(2))(x)
    per_chunk = torch.cat([model(x[:4]), model(x[4:])])
    assert torch.allclose(chunks, per_chunk, atol=TOLERANCE)
    assert not torch.allclose(chunks, model(x), atol=1e-3)


def test_outside_a_step_sync_batchnorm_is_torch_batchnorm():
    model = bn_cnn()
    plain = copy.deepcopy(model)
    replica = dpkit.parallel.replicate(model, ["cpu:0"])[0]  # called by hand: no step, torch's forward
    x, _ = batch(6)
    assert torch.allclose(replica(x), plain(x), atol=TOLERANCE)


def engine_step(strategy, model, x, y, devices=2):
    engine = dpkit.Engine(strategy=strategy, accelerator="cpu", devices=devices)
    wrapped, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    loss = criterion(wrapped(x), y)
    engine.backward(loss)
    return loss, optimizer


@pytest.mark.parametrize("strategy", ["dp", "dp-balanced", "replicated"])
@pytest.mark.parametrize("rows,devices", [(7, 2), (2, 3)])  # uneven; and a device with no rows
def test_engine_strategies_give_whole_batch_gradients(strategy, rows, devices):
    # two rows make batch norm's gradient ill-conditioned (float32 single-device runs differ from float64
    # by 2e-4 there), so that case compares in float64
    dtype = torch.float64 if rows < 4 else torch.float32
    model = bn_cnn().to(dtype)
    reference = copy.deepcopy(model)
    x, y = batch(rows)
    x = x.to(dtype)
    loss, _ = engine_step(strategy, model, x, y, devices)
    assert_matches_single_device(model, reference, loss, single_device_step(reference, x, y))


def test_replicated_without_setup_criterion_gathers_and_still_matches():
    model = bn_cnn()
    reference = copy.deepcopy(model)
    x, y = batch(7)
    engine = dpkit.Engine(strategy="replicated", accelerator="cpu", devices=2)
    wrapped, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = nn.functional.cross_entropy(wrapped(x), y)  # outputs gathered, backward on this thread
    engine.backward(loss)
    assert_matches_single_device(model, reference, loss, single_device_step(reference, x, y))


def test_replicated_keeps_replicas_equal_over_steps():
    model = bn_cnn()
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    engine = dpkit.Engine(strategy="replicated", accelerator="cpu", devices=2)
    wrapped, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    for step in range(3):
        x, y = batch(7, seed=step)
        optimizer.zero_grad()
        engine.backward(criterion(wrapped(x), y))
        optimizer.step()
        reference_optimizer.zero_grad()
        single_device_step(reference, x, y)
        reference_optimizer.step()
    assert_close_to_scale(list(model.parameters()), list(reference.parameters()), TOLERANCE, "weights")
    assert_buffers_match(model, reference)


class FailsOnSecondReplica(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.SyncBatchNorm(4)
        self.fail_rows = 3

    def forward(self, x):
        if x.shape[0] == self.fail_rows:
            raise ValueError("this replica cannot go on")
        return self.bn(x)


def test_a_failing_replica_aborts_the_rendezvous_and_is_named():
    dp = dpkit.DataParallel(FailsOnSecondReplica(), dpkit.cpu_devices(2), chunk_sizes=[4, 3])
    with pytest.raises(ValueError, match="replica 1 .*cannot go on"):
        dp(torch.randn(7, 4))


class SkipsItsNormOnSmallChunks(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.SyncBatchNorm(4)

    def forward(self, x):
        return x if x.shape[0] < 4 else self.bn(x)


def test_a_replica_that_skips_a_layer_is_an_error_not_a_hang():
    dp = dpkit.DataParallel(SkipsItsNormOnSmallChunks(), dpkit.cpu_devices(2), chunk_sizes=[4, 3])
    result = []
    thread = threading.Thread(target=lambda: result.append(pytest.raises(RuntimeError, dp, torch.randn(7, 4))))
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the replicas hung in the SyncBatchNorm rendezvous"
    assert "same SyncBatchNorm layers" in str(result[0].value)


def test_models_without_sync_batchnorm_get_no_rendezvous():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    replicas = dpkit.parallel.replicate(model, ["cpu:0", "cpu:1"])
    assert sync_batchnorm.synced_replicas(model, replicas) == replicas
    assert all("forward" not in m.__dict__ for r in replicas for m in r.modules())
