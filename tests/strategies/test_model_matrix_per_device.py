"""The matrix of issue 32 under the per-device strategies (ddp, fsdp, zero 1 and 2, hsdp) on 2 processes of a
launched group: a loss the model returns (dict, ModelOutput, tuple), gradient checkpointing (reentrant and
not), token-weighted losses with accumulation (`items=`), each cell against one device (max weight difference
1e-5 of the largest weight in float32). All cells of a strategy run in one job of the session's group."""

from __future__ import annotations

import pytest
from model_matrix_runs import CELLS, initial_weights, reference, train_many

from closeness import difference_to_scale

TOLERANCE = 1e-5  # relative to the largest weight (tests/closeness.py): the runs sum in different orders
STRATEGIES = {
    "ddp": {},
    "fsdp": {},
    "zero-1": {"stage": 1},
    "zero-2": {"stage": 2},
    "hsdp": {},
}
# a step that leaves a trainable parameter without a gradient: ddp and zero 1 need find_unused_parameters
# (test_unused_parameters); the others are exact as they are
EXACT_CELLS = [cell for cell in CELLS if cell != "unused"]
UNUSED = {"find_unused_parameters": True}


@pytest.mark.parametrize("label", list(STRATEGIES))
def test_every_cell_equals_one_device(groups, label):
    strategy = label.split("-")[0]
    runs = [dict(strategy=strategy, devices=2, cell=cell, options=STRATEGIES[label]) for cell in EXACT_CELLS]
    results = groups(2).run(train_many, runs)
    for cell, result in zip(EXACT_CELLS, results[0]):
        assert "error" not in result, f"{label} / {cell}: {result.get('error')}"
        diff = difference_to_scale(result["weights"], reference(cell)["weights"])
        assert diff <= TOLERANCE, f"{label} / {cell}: max |diff| / max |weight| {diff:.3g} vs single"


def test_unused_parameters(groups):
    """A parameter used every other step. FSDP2 (fsdp, zero 2, hsdp) is exact as it is, and accepts
    find_unused_parameters (changing nothing); ddp and zero 1 (ddp's model) stop at the first step that leaves it
    out with one line naming the parameters and the option, before the optimizer steps, and are exact with it;
    ddp with static_graph=True is exact on a model whose steps all use the same parameters."""
    runs = {
        "fsdp": dict(strategy="fsdp"),
        "zero-2": dict(strategy="zero", options={"stage": 2}),
        "hsdp": dict(strategy="hsdp"),
        "fsdp + option": dict(strategy="fsdp", options=UNUSED),
        "zero-2 + option": dict(strategy="zero", options={"stage": 2, **UNUSED}),
        "hsdp + option": dict(strategy="hsdp", options=UNUSED),
        "ddp + option": dict(strategy="ddp", options=UNUSED),
        "zero-1 + option": dict(strategy="zero", options={"stage": 1, **UNUSED}),
        "ddp": dict(strategy="ddp"),
        "zero-1": dict(strategy="zero", options={"stage": 1}),
    }
    stopping = ["ddp", "zero-1"]
    static = ["ddp + static_graph / dict", "ddp + static_graph / frozen"]
    jobs = [dict(devices=2, cell="unused", **run) for run in runs.values()]
    jobs += [dict(strategy="ddp", devices=2, cell=cell, options={"static_graph": True}) for cell in ("dict", "frozen")]
    results = dict(zip([*runs, *static], groups(2).run(train_many, jobs)[0]))
    single = reference("unused")["weights"]
    for label in [label for label in runs if label not in stopping]:
        assert "error" not in results[label], f"{label}: {results[label].get('error')}"
        diff = difference_to_scale(results[label]["weights"], single)
        assert diff <= TOLERANCE, f"{label}: max |diff| / max |weight| {diff:.3g} vs single"
    for label, cell in zip(static, ("dict", "frozen")):
        assert "error" not in results[label], f"{label}: {results[label].get('error')}"
        assert difference_to_scale(results[label]["weights"], reference(cell)["weights"]) <= TOLERANCE, label
    start = initial_weights("unused")
    for label in stopping:
        result = results[label]
        assert result.get("error") == (
            "ValueError: find_unused_parameters: parameters spare.weight, spare.bias got no gradient this step "
            "(before the optimizer stepped, the weights are unchanged); pass find_unused_parameters=True, or "
            "freeze them (requires_grad_(False)) before engine.setup"
        ), f"{label}: {result}"
        assert result["failed_at_step"] == 0, label  # the first step leaves `spare` out
        assert difference_to_scale(result["weights"], start) == 0.0, f"{label}: the weights changed before the stop"


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
        diff = difference_to_scale(result["weights"], singles[run["cell"]])
        assert diff < 2e-2, f"{run['strategy']} / {run['cell']} / bf16-mixed: max |diff| / max |weight| {diff:.3g}"
