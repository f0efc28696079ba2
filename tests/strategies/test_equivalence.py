"""The central property: every strategy computes the single-device model.

20 SGD steps from the same seed, global batches of 64 (even shares) and 67 (uneven shares: DDP's own
averaging of per-rank means would be wrong there), on 2 and 3 virtual CPU devices.
"""

from __future__ import annotations

import pytest
import torch
from strategy_runs import STEPS, load_metrics, load_state, max_abs_diff

from closeness import difference_to_scale
from dpkit.examples.digits import DigitsMLP
from dpkit.strategies import available_strategies, strategy_class

# relative to the values' size (tests/closeness.py): the strategies sum the rows' gradients in other orders and
# matrix products of other shapes than one device's
TOLERANCE = 1e-5
# (localsgd and diloco meet every few steps and change the optimization: tests/strategies/test_localsgd_diloco.py)
MULTI_DEVICE = [
    name
    for name in available_strategies()
    if strategy_class(name).traits.max_devices != 1 and strategy_class(name).traits.sync_every == 1
]


@pytest.mark.parametrize("batch_size", [64, 67])
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("strategy", MULTI_DEVICE)
def test_strategy_equals_single(train_run, strategy, devices, batch_size):
    reference = train_run("single", 1, batch_size)
    run = train_run(strategy, devices, batch_size)

    state = load_state(run)
    DigitsMLP().load_state_dict(state)  # a clean state dict for the bare example model
    diff = difference_to_scale(state, load_state(reference))
    where = f"{strategy} on {devices} devices, batch {batch_size}"
    assert diff <= TOLERANCE, f"{where}: weights {diff:.3g} of their size from single's"

    metrics, single = load_metrics(run), load_metrics(reference)
    assert metrics["strategy"] == strategy
    assert metrics["devices"] == [f"cpu:{i}" for i in range(devices)]
    assert len(metrics["loss"]) == STEPS
    # the per-step loss is the global batch's mean loss, whichever process or replica computed it
    losses = torch.tensor(metrics["loss"], dtype=torch.float64)
    assert difference_to_scale(losses, torch.tensor(single["loss"], dtype=torch.float64)) <= TOLERANCE, where
    assert metrics["samples_per_second"] > 0
    # evaluation counts every test sample exactly once
    assert metrics["test_samples"] == single["test_samples"] == 360
    assert metrics["test_accuracy"] == pytest.approx(single["test_accuracy"], abs=1 / 360)


def test_training_moves_the_weights(train_run):
    """Guards the equivalence test against a vacuous pass: the runs do change the model."""
    torch.manual_seed(3)
    initial = DigitsMLP().state_dict()
    trained = load_state(train_run("single", 1, 64))
    assert max_abs_diff(trained, initial) > 1e-2
    loss = load_metrics(train_run("single", 1, 64))["loss"]
    assert loss[-1] < loss[0]


@pytest.mark.parametrize("strategy,devices", [("replicated", 3), ("ddp", 2), ("fsdp", 3)])
def test_gradient_accumulation_equals_single(train_run, strategy, devices):
    """accumulate=2 with momentum: no_sync (ddp) / no sum (replicated) / no reduce-scatter (fsdp) on the first
    micro-batch, then one step."""
    extra = ("--accumulate", "2", "--momentum", "0.9")
    reference = train_run("single", 1, 33, *extra)
    run = train_run(strategy, devices, 33, *extra)
    diff = difference_to_scale(load_state(run), load_state(reference))
    assert diff <= TOLERANCE, f"{strategy}: weights {diff:.3g} of their size from single's with accumulation"
    assert len(load_metrics(run)["loss"]) == STEPS
