"""The matrix of issue 32 under the per-device strategies (ddp, fsdp, zero 1 and 2, hsdp) on 2 processes of a
launched group: a loss the model returns (dict, ModelOutput, tuple), gradient checkpointing (reentrant and
not), token-weighted losses with accumulation (`items=`), each cell against one device (max weight difference
1e-5 in float32). All cells of a strategy run in one job of the session's group."""

from __future__ import annotations

import pytest
from model_matrix_runs import CELLS, max_difference, reference, train_many

TOLERANCE = 1e-5
STRATEGIES = {
    "ddp": {},
    "fsdp": {},
    "zero-1": {"stage": 1},
    "zero-2": {"stage": 2},
    "hsdp": {},
}
# a step that leaves a trainable parameter without a gradient: ddp needs find_unused_parameters (issue 32's
# part for strategies/ddp.py and per_device.py, not built yet); the others are exact
EXACT_CELLS = [cell for cell in CELLS if cell != "unused"]


@pytest.mark.parametrize("label", list(STRATEGIES))
def test_every_cell_equals_one_device(groups, label):
    strategy = label.split("-")[0]
    runs = [dict(strategy=strategy, devices=2, cell=cell, options=STRATEGIES[label]) for cell in EXACT_CELLS]
    results = groups(2).run(train_many, runs)
    for cell, result in zip(EXACT_CELLS, results[0]):
        assert "error" not in result, f"{label} / {cell}: {result.get('error')}"
        diff = max_difference(result["weights"], reference(cell)["weights"])
        assert diff <= TOLERANCE, f"{label} / {cell}: max |diff| {diff:.3g} vs single"


def test_unused_parameters(groups):
    """A parameter used every other step: the sharded strategies are exact; ddp (and zero stage 1, built on it)
    stop with torch's line naming find_unused_parameters (dpkit's own line, before the optimizer steps, and the
    option, are the part of issue 32 left for strategies/ddp.py)."""
    labels = ["fsdp", "zero-2", "hsdp", "ddp", "zero-1"]
    runs = [dict(strategy=label.split("-")[0], devices=2, cell="unused", options=STRATEGIES[label]) for label in labels]
    results = groups(2).run(train_many, runs)[0]
    single = reference("unused")["weights"]
    for label, result in zip(labels[:3], results[:3]):
        assert "error" not in result, f"{label}: {result.get('error')}"
        assert max_difference(result["weights"], single) <= TOLERANCE, label
    for label, result in zip(labels[3:], results[3:]):
        assert "find_unused_parameters" in result.get("error", ""), f"{label}: {result}"


def test_bf16_mixed_cells_stay_close_to_one_device(groups):
    """bf16 keeps 8 bits of mantissa: the runs round differently from one device's, but train the same model."""
    cells = ["dict", "checkpoint", "items"]
    runs = [
        dict(strategy=label.split("-")[0], devices=2, cell=cell, precision="bf16-mixed", options=STRATEGIES[label])
        for label in STRATEGIES
        for cell in cells
    ]
    results = groups(2).run(train_many, runs)[0]
    singles = {cell: reference(cell, "bf16-mixed")["weights"] for cell in cells}
    for run, result in zip(runs, results):
        assert "error" not in result, f"{run}: {result.get('error')}"
        diff = max_difference(result["weights"], singles[run["cell"]])
        assert diff < 2e-2, f"{run['strategy']} / {run['cell']} / bf16-mixed: max |diff| {diff:.3g}"
