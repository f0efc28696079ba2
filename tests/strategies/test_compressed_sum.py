"""The compressed exchange's arithmetic (strategies/compressed_sum.py), in one process: 16-bit sums rounded twice,
PowerSGD exact on low-rank gradients, its error feedback losing nothing over steps, its warm-up uncompressed, and
the values compress= accepts or refuses in one line."""

from __future__ import annotations

import pytest
import torch

from dpkit.strategies import checked_compression
from dpkit.strategies.compressed_sum import CompressedSum, ReplicaPeers
from dpkit.strategies.compression import Compression, compressed_bytes, parse_compression

CPU = torch.device("cpu")


def gradients(seed: int, participants: int = 3) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(40, 24, generator=generator), torch.randn(24, generator=generator) * 1e-3]
        for _ in range(participants)
    ]


def test_sixteen_bits_round_each_gradient_once_sum_in_float32_and_round_the_mean_once():
    grads = gradients(0)
    for kind, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        means = CompressedSum(parse_compression(kind))(["w", "b"], grads, ReplicaPeers(3, CPU))
        for i, mean in enumerate(means):
            rounded = sum(g[i].to(dtype).float() for g in grads)
            assert torch.equal(mean, (rounded / 3).to(dtype).float())
            exact = sum(g[i] for g in grads) / 3
            # within the two roundings of the format: its unit in the last place at the values' scale
            ulp = torch.finfo(dtype).eps * exact.abs().max()
            assert (mean - exact).abs().max() <= 2 * ulp
            assert not torch.equal(mean, exact)


def test_before_its_warm_up_powersgd_is_the_plain_mean():
    exchange = CompressedSum(parse_compression("powersgd:2", warmup_steps=2))
    grads = gradients(1)
    for _ in range(2):
        means = exchange(["w", "b"], grads, ReplicaPeers(3, CPU))
        for i, mean in enumerate(means):
            assert torch.equal(mean, sum(g[i] for g in grads) / 3)
        exchange.step_done()
    assert exchange.compressing_now and not exchange.q


def test_powersgd_is_exact_for_gradients_of_rank_at_most_r():
    generator = torch.Generator().manual_seed(2)
    left, right = torch.randn(3, 40, 2, generator=generator), torch.randn(3, 2, 24, generator=generator)
    grads = [[left[0] @ right[p]] for p in range(3)]  # rank 2 each, every one in the span of left[0]
    exchange = CompressedSum(Compression("powersgd", rank=2, warmup_steps=0))
    (mean,) = exchange(["w"], grads, ReplicaPeers(3, CPU))
    exact = sum(g[0] for g in grads) / 3
    assert (mean - exact).abs().max() <= 1e-5 * exact.abs().max()


def test_powersgd_error_feedback_loses_nothing_over_steps():
    """What every participant applied over the steps plus what is still held back equals the sum of its gradients:
    the approximation's misses are added to the next steps, not dropped."""
    exchange = CompressedSum(Compression("powersgd", rank=1, warmup_steps=0))
    applied = torch.zeros(40, 24, dtype=torch.float64)
    given = torch.zeros(40, 24, dtype=torch.float64)
    for step in range(6):
        grads = gradients(10 + step)
        means = exchange(["w", "b"], grads, ReplicaPeers(3, CPU))
        applied += means[0].double()
        given += sum(g[0].double() for g in grads) / 3
        exchange.step_done()
    held_back = sum(error.double() for error in exchange.error["w"]).view(40, 24) / 3
    assert (applied + held_back - given).abs().max() <= 1e-5 * given.abs().max()
    assert (applied - given).abs().max() > 1e-2 * given.abs().max()  # rank 1 does miss a part each step


def test_the_state_restores_the_exchange_bit_for_bit():
    one, two = (CompressedSum(Compression("powersgd", rank=2, warmup_steps=1)) for _ in range(2))
    for step in range(3):
        one(["w", "b"], gradients(step), ReplicaPeers(3, CPU))
        one.step_done()
    two.load_state_dict(one.state_dict(), CPU)
    after_one = one(["w", "b"], gradients(7), ReplicaPeers(3, CPU))
    after_two = two(["w", "b"], gradients(7), ReplicaPeers(3, CPU))
    assert all(torch.equal(a, b) for a, b in zip(after_one, after_two))


def test_compressed_bytes_counts_what_crosses():
    shapes = [(512, 256), (512,)]
    floats = 512 * 256 + 512
    assert compressed_bytes(shapes, parse_compression("none")) == floats * 4
    assert compressed_bytes(shapes, parse_compression("bf16")) == floats * 2
    assert compressed_bytes(shapes, parse_compression("powersgd:4")) == ((512 + 256) * 4 + 512) * 4


@pytest.mark.parametrize(
    "value,said",
    [
        ("zip", "compress: expected none, bf16, fp16, powersgd or powersgd:R"),
        ("powersgd:0", "compress: the rank of 'powersgd:0' is not a positive int"),
        ("powersgd:x", "compress: the rank of 'powersgd:x' is not a positive int"),
        ("bf16:2", "compress: expected none, bf16, fp16, powersgd or powersgd:R"),
    ],
)
def test_a_value_compress_does_not_know_is_one_line(value, said):
    with pytest.raises(ValueError) as refused:
        parse_compression(value)
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)


def test_each_strategy_takes_what_its_exchange_allows_and_says_who_takes_the_rest():
    assert checked_compression("ddp", {"compress": "powersgd:3"}) == {"compress": "powersgd:3"}
    assert checked_compression("hsdp", {"compress": "fp16"}) == {"compress": "fp16"}
    assert checked_compression("single", {"compress": "none"}) == {}  # nothing to compress, nothing to refuse
    with pytest.raises(ValueError) as refused:
        checked_compression("zero", {"compress": "powersgd", "stage": 2})
    assert str(refused.value) == (
        "compress: strategy 'zero' stage=2 reduce-scatters gradients to their shards and takes bf16 or fp16 only, "
        "got 'powersgd:2'; powersgd goes with replicated, ddp, zero stage 1, localsgd, diloco"
    )
    with pytest.raises(ValueError) as refused:
        checked_compression("dp", {"compress": "bf16"})
    assert str(refused.value).startswith("compress: strategy 'dp' has no gradient exchange to compress")
    assert str(refused.value).endswith("bf16 goes with replicated, ddp, fsdp, zero, hsdp, localsgd, diloco")
