"""Comparing two computations of the same numbers: bitwise where they run the same kernels, within a tolerance
relative to the values' size where they do not.

Bitwise equality (torch.equal) holds on every CPU only where both sides run the same kernels in the same order:
the same shapes, the same intra-op thread count (`intra_op_threads`), the same summation order; a run repeated
in the same process, serial replicas against threaded ones. Where the two sides compute the same value in
different ways (the sum of per-replica gradients against one device's gradient of the whole batch; a chunk of
rows against all of them, whose matrix products block differently; one thread against two), how they round
depends on the CPU (AVX-512, AVX2 or plain kernels, MKL's dispatch) and on the thread count, and the difference
grows with the values. So the tolerance is relative to their size, max|a - b| <= rtol * max|b|, the maximum
taken over everything compared together (a model's every weight or gradient): a bias gradient that cancels to
about zero behind a batch norm is measured against the size of the numbers it was computed from, not its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch

Tensors = torch.Tensor | Sequence[torch.Tensor | None] | Mapping[str, torch.Tensor]

# float32 has 24 bits (a unit in the last place is 6e-8 of the value): 1e-5 is about 170 of them, room for the
# few roundings of a different blocking or summation order, and far below what a wrong formula gives
FLOAT32 = 1e-5
FLOAT64 = 1e-12  # float64's last place is 1.1e-16 of the value: thousands of them, still far below any wrong formula


def _pairs(actual: Tensors, expected: Tensors) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"a tensor against {type(actual).__name__}"
        return [(actual, expected)]
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping) and actual.keys() == expected.keys(), (
            f"different keys: {sorted(actual)} vs {sorted(expected)}"
        )
        return [(actual[key], expected[key]) for key in expected]
    actual = list(actual)
    assert len(actual) == len(expected), f"{len(actual)} tensors against {len(expected)}"
    pairs = []
    for index, (a, b) in enumerate(zip(actual, expected)):
        assert (a is None) == (b is None), f"[{index}]: {'None' if a is None else 'a tensor'} against the other's"
        if a is not None:
            pairs.append((a, b))
    return pairs


def difference_to_scale(actual: Tensors, expected: Tensors) -> float:
    """The largest |a - b| over every pair (single tensors, sequences in order, dicts by key) divided by the largest
    |b|; 0 where both are zero everywhere, infinite where only the expected values are."""
    pairs = _pairs(actual, expected)
    assert pairs, "nothing to compare"
    for index, (a, b) in enumerate(pairs):
        assert a.shape == b.shape, f"[{index}]: shape {tuple(a.shape)} against {tuple(b.shape)}"
    pairs = [(a.detach().double(), b.detach().double()) for a, b in pairs if b.numel()]
    difference = max(((a - b).abs().max().item() for a, b in pairs), default=0.0)
    scale = max((b.abs().max().item() for _, b in pairs), default=0.0)
    if difference == 0:
        return 0.0
    return difference / scale if scale else float("inf")


def rtol_for(expected: Tensors) -> float:
    """FLOAT64 where the expected values are float64, FLOAT32 otherwise."""
    first = next(iter(b for _, b in _pairs(expected, expected)))
    return FLOAT64 if first.dtype == torch.float64 else FLOAT32


def assert_close_to_scale(actual: Tensors, expected: Tensors, rtol: float | None = None, what: str = "values") -> None:
    """max|a - b| <= rtol * max|b| over everything compared (rtol: FLOAT32 or FLOAT64 by the expected dtype)."""
    rtol = rtol_for(expected) if rtol is None else rtol
    difference = difference_to_scale(actual, expected)
    assert difference <= rtol, f"{what}: differ by {difference:.3g} of their size (tolerance {rtol:g})"


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """This thread computes with `count` intra-op threads inside the block (as a replica does), then as before:
    a reference that must be bitwise equal to a replica's result runs with the replica's thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
