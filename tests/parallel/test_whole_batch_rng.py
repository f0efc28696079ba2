"""WholeBatchDraws: replicas holding rows of a batch draw exactly those rows of what one device draws for the
whole batch, in their own threads, and the default generator ends where one device leaves it; what cannot
be drawn so is named."""

from __future__ import annotations

import threading

import pytest
import torch

from dpkit.parallel.whole_batch_rng import WholeBatchDraws, finish_draws


def draws(rows: int) -> list[torch.Tensor]:
    """What a step draws for a batch of `rows` rows: dropout, factories, *_like, in-place samplers, a
    tensor that is not batch-shaped (drawn whole by every replica)."""
    x = torch.ones(rows, 5)
    return [
        torch.nn.functional.dropout(x, 0.4, training=True),
        torch.nn.functional.dropout2d(torch.ones(rows, 3, 2, 2), 0.5, training=True),
        torch.randn(rows, 3),
        torch.rand(rows),
        torch.randint(0, 9, (rows, 2)),
        torch.randn_like(x),
        torch.rand_like(x),
        torch.bernoulli(x, 0.3),
        torch.empty(rows, 2).uniform_(-1, 1),
        torch.empty(rows, 2).normal_(2.0, 0.5),
        torch.rand(11),  # not the batch's rows: every replica draws what one device draws once
        torch.normal(0.0, 1.0, size=(rows, 2)),
    ]


def in_threads(state: torch.Tensor, sizes: list[int], step=draws) -> tuple[list[list[torch.Tensor]], list]:
    total, outputs, modes = sum(sizes), [None] * len(sizes), [None] * len(sizes)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def job(i: int) -> None:
        with WholeBatchDraws(state, offsets[i], sizes[i], total) as mode:
            outputs[i] = step(sizes[i])
        modes[i] = mode

    threads = [threading.Thread(target=job, args=(i,)) for i in range(len(sizes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outputs, modes


@pytest.mark.parametrize("sizes", [[4, 3], [3, 3, 2], [1, 5, 1, 2]])
def test_replicas_draw_their_rows_of_one_devices_draws(sizes):
    torch.manual_seed(5)
    state = torch.default_generator.get_state()
    reference = draws(sum(sizes))
    end = torch.default_generator.get_state()
    torch.manual_seed(123)  # the replicas must not depend on the default generator while they run
    outputs, modes = in_threads(state, sizes)
    assert finish_draws(state, modes) == []
    for k, whole in enumerate(reference):
        if whole.shape[0] == sum(sizes):
            assert torch.equal(torch.cat([out[k] for out in outputs]), whole), f"draw {k}"
        else:
            assert all(torch.equal(out[k], whole) for out in outputs), f"draw {k}"
    assert torch.equal(torch.default_generator.get_state(), end)


def test_per_replica_generators_would_not_be_one_devices_draws():
    """What the mode fixes: the same chunks drawn from generators of their own differ from one device's."""
    torch.manual_seed(5)
    whole = torch.nn.functional.dropout(torch.ones(7, 5), 0.4, training=True)
    chunks = []
    for seed, rows in ((1, 4), (2, 3)):
        torch.manual_seed(seed)
        chunks.append(torch.nn.functional.dropout(torch.ones(rows, 5), 0.4, training=True))
    assert not torch.equal(torch.cat(chunks), whole)


def test_operators_that_read_the_rows_are_named():
    torch.manual_seed(0)
    state = torch.default_generator.get_state()

    def step(rows: int) -> list[torch.Tensor]:
        probabilities = torch.full((rows, 3), 0.5)
        return [torch.bernoulli(probabilities), torch.multinomial(probabilities, 2)]

    _, modes = in_threads(state, [2, 2], step)
    assert finish_draws(state, modes) == ["aten.bernoulli.default", "aten.multinomial.default"]


def test_replicas_that_draw_differently_are_named_and_nothing_drawn_leaves_the_state():
    torch.manual_seed(0)
    state = torch.default_generator.get_state()
    _, modes = in_threads(state, [2, 2], lambda rows: [torch.randn(rows, 2 if rows == 2 else 3)])
    assert finish_draws(state, modes) == []  # the same operators, the same shapes

    def uneven(rows: int) -> list[torch.Tensor]:
        return [torch.randn(rows, 2)] + ([torch.rand(3)] if rows == 3 else [])

    _, modes = in_threads(state, [3, 2], uneven)
    assert finish_draws(state, modes) == ["replicas that drew different random numbers"]
    torch.manual_seed(9)
    _, modes = in_threads(state, [3, 2], lambda rows: [torch.ones(rows)])
    assert finish_draws(state, modes) == []
    assert torch.equal(torch.default_generator.get_state(), state)  # one device would not have drawn either


def test_a_generator_the_caller_passes_is_used_as_given():
    generator = torch.Generator().manual_seed(3)
    expected = torch.rand(4, 2, generator=torch.Generator().manual_seed(3))
    with WholeBatchDraws(torch.default_generator.get_state(), 0, 4, 8) as mode:
        drawn = torch.rand(4, 2, generator=generator)
    assert torch.equal(drawn, expected) and not mode.drew
