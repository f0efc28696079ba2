"""The built-in examples (dpkit.examples.EXAMPLES): each builds, loads its data the way `dpkit train` needs
it, and runs a forward; `wide-blocks` is what sharding is for: fsdp holds at most 0.6x of ddp's training state."""

import json

import pytest
import torch

from dpkit.cli.main import main
from dpkit.examples import EXAMPLES, get_example
from dpkit.strategies.fsdp import shard_units
from dpkit.training.sources import model_source


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_builds_loads_class_labels_and_runs_a_forward(name):
    example = get_example(name)
    assert example.name == name and example.description
    x_train, y_train, x_test, y_test = model_source(example=name).load_classification_data(seed=0)
    again = example.load_data(0)
    assert all(torch.equal(a, b) for a, b in zip((x_train, y_train, x_test, y_test), again))  # from the seed
    assert len(x_train) >= 1000 and len(x_test) > 0
    model = example.build_model()
    with torch.no_grad():
        logits = model(x_test[:8])
    assert logits.shape[0] == 8 and logits.shape[1] > int(max(y_train.max(), y_test.max()))
    assert len(y_train.unique()) > 1  # more than one class to learn


def test_wide_blocks_weights_dominate_and_each_block_is_an_fsdp_unit():
    model = get_example("wide-blocks").build_model()
    parameters = sum(p.numel() for p in model.parameters())
    assert parameters * 4 > 25 * 2**20  # tens of MB of float32 weights
    assert shard_units(model) == list(model.blocks)  # fsdp's default rule: the ModuleList's blocks


@pytest.mark.slow
def test_wide_blocks_fsdp_keeps_at_most_0_6x_of_ddps_training_state_per_device(tmp_path):
    state = {}
    for strategy in ("ddp", "fsdp"):
        out = tmp_path / f"{strategy}.json"
        argv = ["profile", "--example", "wide-blocks", "--strategy", strategy, "--accelerator", "cpu"]
        argv += ["--devices", "2", "--batch-size", "64", "--steps", "1", "--warmup", "1", "--no-progress"]
        assert main([*argv, "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        assert len(report["devices"]) == 2
        # parameters, gradients and optimizer state at each device's peak, as the table shows them
        state[strategy] = max(
            sum(d["bytes_by_category"][c] for c in ("parameters", "gradients", "optimizer_state"))
            for d in report["devices"]
        )
    assert state["fsdp"] <= 0.6 * state["ddp"]
