"""Token-weighted losses, `engine.backward(loss_sum, items=n)` (issue 32): with padding (ignore_index) and
accumulation, every single-process strategy's step equals one device's step on the whole batch with the mean
over its tokens; the loss computed on gathered outputs or in the replicas alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpkit
import dpkit.observe  # noqa: F401  # plugs in the measured balance dp-balanced needs (lazy dpkit import: see issue 32 note)
from closeness import difference_to_scale

TOLERANCE = 1e-5  # relative to the largest weight (tests/closeness.py): the replicas sum in other orders
VOCAB = 16
STEPS = 3


def token_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB))


def step_batches(accumulate):
    """STEPS steps of `accumulate` micro-batches of 6 rows x 5 tokens, padded unevenly (-100: ignored)."""
    generator = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(STEPS):
        micro = []
        for _ in range(accumulate):
            ids = torch.randint(0, VOCAB, (6, 5), generator=generator)
            labels = torch.randint(0, VOCAB, (6, 5), generator=generator)
            lengths = torch.randint(0, 6, (6,), generator=generator)  # some rows all padding
            labels[torch.arange(5)[None, :] >= lengths[:, None]] = -100
            micro.append((ids, labels))
        steps.append(micro)
    return steps


def token_sum(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def reference_weights(accumulate):
    """One device, the step's whole batch, the mean over its tokens."""
    model = token_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for micro in step_batches(accumulate):
        ids = torch.cat([i for i, _ in micro])
        labels = torch.cat([y for _, y in micro])
        optimizer.zero_grad()
        F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def engine_weights(strategy, accumulate, in_replicas, clip=None):
    model = token_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = dpkit.Engine(
        strategy=strategy, accelerator="cpu", devices=1 if strategy == "single" else 2, accumulate=accumulate
    )
    model, optimizer = engine.setup(model, optimizer)
    criterion = engine.setup_criterion(token_sum) if in_replicas else token_sum
    for micro in step_batches(accumulate):
        for ids, labels in micro:
            optimizer.zero_grad()
            engine.backward(criterion(model(ids), labels), items=(labels != -100).sum())
        if clip is not None:
            engine.clip_gradients(optimizer, clip)
        optimizer.step()
    return [p.detach().clone() for p in dpkit.unwrap_model(model).parameters()]


@pytest.mark.parametrize("in_replicas", [False, True], ids=["loss-on-outputs", "loss-in-replicas"])
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("strategy", ["single", "dp", "dp-balanced", "replicated"])
def test_token_weighted_step_equals_one_device(strategy, accumulate, in_replicas):
    reference = reference_weights(accumulate)
    weights = engine_weights(strategy, accumulate, in_replicas)
    assert max((a - b).abs().max().item() for a, b in zip(reference, token_model().parameters())) > 1e-2
    diff = difference_to_scale(weights, reference)
    assert diff <= TOLERANCE, f"{strategy}, accumulate {accumulate}: weights {diff:.3g} of their size apart"


def test_row_means_with_accumulation_are_not_the_token_mean():
    """Guards the test above: the plain mean loss per micro-batch misses the token mean by far more."""
    model = token_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = dpkit.Engine(strategy="single", accelerator="cpu", devices=1, accumulate=3)
    model, optimizer = engine.setup(model, optimizer)
    for micro in step_batches(3):
        for ids, labels in micro:
            engine.backward(F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100))
        optimizer.step()
    assert difference_to_scale(list(model.parameters()), reference_weights(3)) > 100 * TOLERANCE


def test_clipping_sees_the_divided_gradients():
    weights = engine_weights("dp", 3, False, clip=1e9)  # a bound no norm reaches: clipping changes nothing
    assert difference_to_scale(weights, reference_weights(3)) <= TOLERANCE


def test_a_step_with_no_items_is_refused_before_the_weights_change():
    model = token_model()
    before = [p.detach().clone() for p in model.parameters()]
    engine = dpkit.Engine(strategy="dp", accelerator="cpu", devices=2)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    ids = torch.zeros(4, 5, dtype=torch.long)
    labels = torch.full((4, 5), -100)
    with pytest.raises(ValueError, match="items: the step's 1 micro-batch hold 0 items"):
        engine.backward(token_sum(model(ids), labels) + 0 * model(ids).sum(), items=0)
    assert all(torch.equal(a, b) for a, b in zip(before, dpkit.unwrap_model(model).parameters()))


@pytest.mark.parametrize("items", [-1, float("nan"), "3", True])
def test_items_must_be_a_count(items):
    engine = dpkit.Engine(strategy="single", accelerator="cpu", devices=1)
    model = engine.setup(token_model())
    with pytest.raises(ValueError, match="items: expected the number of items"):
        engine.backward(model(torch.zeros(2, 5, dtype=torch.long)).sum(), items=items)


def test_a_window_mixing_sums_and_means_is_refused():
    engine = dpkit.Engine(strategy="single", accelerator="cpu", devices=1, accumulate=2)
    model = engine.setup(token_model())
    ids = torch.zeros(2, 5, dtype=torch.long)
    engine.backward(model(ids).sum(), items=10)
    with pytest.raises(ValueError, match="items: give items= to every engine.backward"):
        engine.backward(model(ids).mean())


class TokenSum(nn.Module):
    """A criterion that says it sums its rows, as torch's losses with reduction="sum" do."""

    reduction = "sum"

    def forward(self, logits, labels):
        return token_sum(logits, labels)


@pytest.mark.parametrize("strategy", ["dp-balanced", "replicated"])
def test_a_summing_criterion_in_the_replicas_returns_the_whole_batch_sum(strategy):
    """The loss such a criterion returns is the sum over every replica's rows (what `dpkit train` shows), not the
    replicas' sums averaged by rows; its step with items= is one device's token mean."""
    ids, labels = step_batches(1)[0][0]
    whole = token_sum(token_model()(ids), labels).item()
    model = token_model()
    engine = dpkit.Engine(strategy=strategy, accelerator="cpu", devices=2)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    criterion = engine.setup_criterion(TokenSum())
    assert criterion(model(ids), labels).item() == pytest.approx(whole, rel=1e-6)
    for micro in step_batches(1):
        for ids, labels in micro:
            optimizer.zero_grad()
            engine.backward(criterion(model(ids), labels), items=(labels != -100).sum())
        optimizer.step()
    weights = list(dpkit.unwrap_model(model).parameters())
    assert difference_to_scale(weights, reference_weights(1)) <= TOLERANCE
