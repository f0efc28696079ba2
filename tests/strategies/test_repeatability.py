"""Bit-equality where dpkit promises it: the same strategy, topology, seed and machine, run twice."""

from __future__ import annotations

import pytest
import torch
from strategy_runs import load_metrics, load_state


@pytest.mark.parametrize("strategy,devices", [("dp", 2), ("replicated", 3), ("ddp", 2)])
def test_same_run_twice_is_bitwise_equal(train_run, tmp_path, strategy, devices):
    first = train_run(strategy, devices, 67)
    # (ddp runs as ranks of a launched group, as the first run did; `dpkit train` starting its own processes
    # and resuming bitwise is tests/cli/test_train.py's)
    again = train_run.run_into(tmp_path / "again", strategy, devices, 67)
    a, b = load_state(first), load_state(again)
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), f"{strategy}: {key} differs between two identical runs"
    assert load_metrics(first)["loss"] == load_metrics(again)["loss"]
