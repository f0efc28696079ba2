"""The gradient sum among replicas: equals the manual sum, bucketed/overlapped equals unbucketed, missing grads."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpkit
from closeness import intra_op_threads
from dpkit.devices import cpu_threads_per_device
from dpkit.parallel.reduce import GradientSum, plan_buckets, plan_shares


def replicas(n: int, width: int = 24) -> list[nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))
    return [model] + [copy.deepcopy(model) for _ in range(n - 1)]


def roots(models: list[nn.Module], rows: list[int]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for i, (model, n) in enumerate(zip(models, rows)):
        if n:
            loss = model(torch.randn(n, 8, generator=generator)).square().sum()
            out.append((i, loss, torch.tensor(1.0)))
    return out


def manual_sums(models, rows, threads: int | None = None) -> list[torch.Tensor]:
    """The replicas' gradients summed in replica order, each backward run with `threads` intra-op threads (default:
    a replica's share; a matrix product splits its sums by the thread count): bitwise what GradientSum must give."""
    losses = roots(models, rows)  # the forwards on this thread, as the tests' own
    with intra_op_threads(threads or cpu_threads_per_device(len(models))):
        for _, loss, grad in losses:
            loss.backward(grad)
    grads = [[p.grad for p in m.parameters()] for m in models]
    return [sum(g for g in group if g is not None) for group in zip(*grads)]


@pytest.mark.parametrize("coalesce", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("bucket_cap_bytes", [1, 1000, 10**9])
@pytest.mark.parametrize("rows", [[4, 4, 4], [9, 2, 1], [3, 0, 2]])
def test_every_replica_holds_the_sum_bitwise_equal_to_the_manual_sum(coalesce, overlap, bucket_cap_bytes, rows):
    expected = manual_sums(replicas(3), rows)
    models = replicas(3)
    gradient_sum = GradientSum(
        [list(m.parameters()) for m in models],
        dpkit.cpu_devices(3),
        bucket_cap_bytes=bucket_cap_bytes,
        overlap=overlap,
        coalesce=coalesce,
    )
    gradient_sum.backward(roots(models, rows), sync=True)
    for model in models:
        for grad, want in zip((p.grad for p in model.parameters()), expected):
            assert torch.equal(grad, want)
    gradient_sum.remove_hooks()


def test_without_sync_each_replica_keeps_its_own_gradient_and_a_later_sync_sums_the_accumulation():
    models = replicas(2)
    gradient_sum = GradientSum([list(m.parameters()) for m in models], dpkit.cpu_devices(2), bucket_cap_bytes=1000)
    gradient_sum.backward(roots(models, [3, 5]), sync=False)
    first = [[p.grad.clone() for p in m.parameters()] for m in models]
    assert not torch.equal(first[0][0], first[1][0])
    gradient_sum.backward(roots(models, [3, 5]), sync=True)  # the same micro-batch again, then the sum
    for model in models:
        for grad, a, b in zip((p.grad for p in model.parameters()), *first):
            assert torch.allclose(grad, 2 * (a + b), atol=1e-5)


def test_a_gradient_missing_in_some_replicas_counts_as_zero_and_none_stays_none():
    models = replicas(3)
    for m in models:
        m.register_parameter("unused", nn.Parameter(torch.zeros(3)))
    models[1].unused.grad = torch.ones(3)  # e.g. used by one replica in an earlier micro-batch
    gradient_sum = GradientSum([list(m.parameters()) for m in models], dpkit.cpu_devices(3))
    gradient_sum.backward(roots(models, [2, 2, 2]), sync=True)
    assert all(torch.equal(m.unused.grad, torch.ones(3)) for m in models)
    models2 = replicas(2)
    for m in models2:
        m.register_parameter("unused", nn.Parameter(torch.zeros(3)))
    GradientSum([list(m.parameters()) for m in models2], dpkit.cpu_devices(2)).backward(
        roots(models2, [2, 2]), sync=True
    )
    assert all(m.unused.grad is None for m in models2)


def test_sum_now_after_a_backward_elsewhere_equals_the_manual_sum():
    expected = manual_sums(replicas(2), [3, 4], threads=torch.get_num_threads())
    models = replicas(2)
    for _, loss, grad in roots(models, [3, 4]):
        loss.backward(grad)  # on this thread, as the gathered-output path does
    GradientSum([list(m.parameters()) for m in models], dpkit.cpu_devices(2)).sum_now()
    for model in models:
        assert all(torch.equal(p.grad, want) for p, want in zip(model.parameters(), expected))


def test_an_error_in_one_replicas_backward_is_named_and_nobody_hangs():
    models = replicas(2)
    gradient_sum = GradientSum([list(m.parameters()) for m in models], dpkit.cpu_devices(2))
    good = roots(models, [2, 2])
    bad = [(good[0][0], good[0][1], torch.ones(3)), good[1]]  # a grad_output of the wrong shape
    with pytest.raises(RuntimeError, match="replica 0 on device cpu:0"):
        gradient_sum.backward(bad, sync=True)


def test_buckets_run_backwards_through_the_parameters_within_the_cap():
    params = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5)]  # 40, 40, 120, 20 bytes
    assert plan_buckets(params, 100) == [[3], [2], [1, 0]]
    assert plan_buckets(params, 1) == [[3], [2], [1], [0]]


@pytest.mark.parametrize("shares", [1, 2, 3, 5])
def test_a_bucket_is_cut_in_shares_of_about_equal_size_covering_every_element_once(shares):
    generator = torch.Generator().manual_seed(shares)
    for _ in range(50):
        params = [
            torch.zeros(int(n)) for n in torch.randint(1, 300, (int(torch.randint(1, 9, (1,))),), generator=generator)
        ]
        bucket = list(reversed(range(len(params))))
        cut = plan_shares(params, bucket, shares)
        assert len(cut) == shares
        covered = {position: [] for position in bucket}
        for share in cut:
            for position, lo, hi in share:
                covered[position].append((lo, hi))
        for position, runs in covered.items():  # each parameter's elements exactly once, in runs
            runs.sort()
            assert runs[0][0] == 0 and runs[-1][1] == params[position].numel()
            assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
        sizes = [sum(hi - lo for _, lo, hi in share) for share in cut]
        total = sum(p.numel() for p in params)
        assert sum(sizes) == total and max(sizes) - min(sizes) <= total // shares + 1


def test_with_one_bucket_no_parameter_is_hooked_and_with_several_each_is():
    models = replicas(2)
    params = [list(m.parameters()) for m in models]
    one = GradientSum(params, dpkit.cpu_devices(2))  # a few KB: one bucket
    several = GradientSum(params, dpkit.cpu_devices(2), bucket_cap_bytes=100)
    assert len(one.buckets) == 1 and not one.hooked and one._handles == []
    assert len(several.buckets) > 1 and several.hooked and len(several._handles) == 2 * len(params[0])
    several.remove_hooks()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="bucket_cap_bytes"):
        GradientSum([[], []], dpkit.cpu_devices(2), bucket_cap_bytes=0)
    with pytest.raises(ValueError, match="params: has 1 replicas"):
        GradientSum([[]], dpkit.cpu_devices(2))


def sum_of_two_micro_batches(way: str, rows: list[int], bucket_cap_bytes: int) -> tuple[list, set]:
    """Every replica's gradients after an accumulated micro-batch and a summed one; the threads backward ran in."""
    import threading

    models = replicas(3)
    ran_in = set()
    for model in models:
        model[0].weight.register_hook(lambda grad: ran_in.add(threading.current_thread().name))
    gradient_sum = GradientSum(
        [list(m.parameters()) for m in models],
        dpkit.cpu_devices(3),
        bucket_cap_bytes=bucket_cap_bytes,
        concurrency=way,
    )
    gradient_sum.backward(roots(models, rows), sync=False)
    gradient_sum.backward(roots(models, rows), sync=True)
    gradient_sum.remove_hooks()
    return [[p.grad for p in m.parameters()] for m in models], ran_in


@pytest.mark.parametrize("bucket_cap_bytes", [1, 10**9])
@pytest.mark.parametrize("rows", [[4, 4, 4], [9, 2, 1], [3, 0, 2]])
def test_serial_backwards_give_the_sum_of_side_by_side_bitwise(bucket_cap_bytes, rows):
    import threading

    expected, threads_side_by_side = sum_of_two_micro_batches("threads", rows, bucket_cap_bytes)
    got, threads = sum_of_two_micro_batches("serial", rows, bucket_cap_bytes)
    for mine, want in zip(got, expected):
        assert all(torch.equal(a, b) for a, b in zip(mine, want))
    here = threading.current_thread().name
    assert here not in threads_side_by_side
    assert threads == {here}


def test_auto_backwards_measure_backward_and_sum_together_then_keep_one_way():
    models = replicas(2)
    gradient_sum = GradientSum([list(m.parameters()) for m in models], dpkit.cpu_devices(2))
    policy = gradient_sum.concurrency
    assert policy.declared == "auto" and policy.choice() is None
    runs = policy.WARMUP + 2 * policy.SAMPLES
    for _ in range(runs):
        gradient_sum.backward(roots(models, [3, 5]), sync=True)
    chosen = policy.choice()
    assert chosen in ("threads", "serial")
    assert [len(v) for v in policy.measured().values()] == [policy.SAMPLES] * 2
    gradient_sum.backward(roots(models, [3, 5]), sync=True)
    assert policy.choice() == chosen and [len(v) for v in policy.measured().values()] == [policy.SAMPLES] * 2
    # without coalesce (the per-parameter sum kept for measuring) the backwards always run side by side
    plain = GradientSum([list(m.parameters()) for m in models], dpkit.cpu_devices(2), coalesce=False)
    assert plain.concurrency.choice() == "threads"
