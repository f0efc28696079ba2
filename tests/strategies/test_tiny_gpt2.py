"""A real transformers model with the unchanged transformers loop (`out = model(**batch);
engine.backward(out.loss)`), labels and gradient checkpointing on, under every strategy: the weights after three
steps equal one device's (issue 32). No download: GPT-2 built from a tiny config."""

from __future__ import annotations

import functools

import pytest
import torch

import dpkit
import dpkit.observe  # noqa: F401  # plugs in the measured balance dp-balanced needs
from closeness import difference_to_scale

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5  # relative to the largest weight (tests/closeness.py): the runs sum in different orders


def tiny_gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@functools.cache  # the single-device reference, once for every strategy
def train(strategy):
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = dpkit.Engine(strategy=strategy, accelerator="cpu", devices=1 if strategy == "single" else 2)
    model, optimizer = engine.setup(model, optimizer)
    model.train()
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):  # the same batch: its loss falls
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        optimizer.zero_grad()
        out = model(**batch)
        engine.backward(out.loss)
        optimizer.step()
        losses.append(out.loss.item())
    state = dpkit.unwrap_model(model).state_dict()
    return {k: v.detach().clone() for k, v in state.items() if v.is_floating_point()}, losses


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")  # transformers 5's rename
@pytest.mark.parametrize("strategy", ["dp", "dp-balanced", "replicated"])
def test_tiny_gpt2_with_checkpointing_equals_single(strategy):
    reference, reference_losses = train("single")
    weights, losses = train(strategy)
    assert reference_losses[-1] < reference_losses[0]  # the steps trained the model
    diff = difference_to_scale(weights, reference)
    assert diff <= TOLERANCE, f"{strategy}: weights {diff:.3g} of their size from single's"
    assert losses == pytest.approx(reference_losses, rel=TOLERANCE)


# the strategies with a process per device (ddp, fsdp, zero, hsdp), in one launched group of 2
# (localsgd and diloco meet every few steps and change the optimization: tests/strategies/test_localsgd_diloco.py)
PER_DEVICE = dpkit.strategies.matching(
    lambda traits: traits.processes == dpkit.strategies.PER_DEVICE and traits.sync_every == 1
)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
def test_tiny_gpt2_with_checkpointing_equals_single_under_every_process_per_device_strategy(tmp_path, groups):
    from gpt2_runs import tiny_gpt2, train_many

    runs = [(strategy, 2, str(tmp_path / f"{strategy}.pt")) for strategy in PER_DEVICE]
    groups(2).run(train_many, runs)
    reference, _ = train("single")
    for strategy, _, path in runs:
        model = dpkit.load_model(tiny_gpt2(), path)
        weights = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
        diff = difference_to_scale(weights, reference)
        assert diff <= TOLERANCE, f"{strategy}: weights {diff:.3g} of their size from single's"
