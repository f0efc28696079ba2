"""The built-in examples (dpkit.examples.EXAMPLES): each builds, loads its data the way `dpkit train` needs
it, and runs a forward; `wide-blocks` is what sharding is for: fsdp holds at most 0.6x of ddp's training state;
the launch-bound ones are many small layers on small inputs, and learn."""

import json

import pytest
import torch

from dpkit.cli.main import main
from dpkit.examples import EXAMPLES, get_example
from dpkit.recipe.sources import model_source
from dpkit.strategies.fsdp import shard_units


def test_digits_are_scikit_learns_split_by_class_and_seed():
    """Read from scikit-learn's bundled file without importing it (run in a fresh process to see that), the
    same rows as its own loader; each class's share of the 360 test rows is its share of the data."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits as sklearn_digits

    from dpkit.examples.digits import load_digits

    code = (
        "import sys; from dpkit.examples.digits import load_digits; load_digits(); assert 'sklearn' not in sys.modules"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0
    x_train, y_train, x_test, y_test = load_digits(seed=0)
    assert len(x_train) == 1437 and len(x_test) == 360
    reference = sklearn_digits()
    x, y = torch.cat([x_train, x_test]), torch.cat([y_train, y_test])
    rows = sorted(zip(x.mul(16).round().int().tolist(), y.tolist()))
    expected = sorted(zip(torch.tensor(reference.data).int().tolist(), reference.target.tolist()))
    assert rows == expected  # every row once, with its label
    counts, test_counts = torch.bincount(y), torch.bincount(y_test, minlength=10)
    assert ((test_counts - 0.2 * counts).abs() < 1).all()
    again, other = load_digits(seed=0), load_digits(seed=1)
    assert torch.equal(again[3], y_test) and torch.equal(again[2], x_test)
    assert not torch.equal(other[2], x_test)


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


@pytest.mark.parametrize("name", ["launch-bound", "launch-bound-conv"])
def test_launch_bound_examples_are_many_small_layers_on_small_inputs(name):
    model = get_example(name).build_model()
    x = get_example(name).load_data(0)[0]
    weighted = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    assert len(weighted) >= 12 and all(m.weight.numel() <= 32 * 32 for m in weighted)
    assert sum(p.numel() for p in model.parameters()) < 50_000 and x[0].numel() <= 64
    assert len(list(model.modules())) >= 2 * len(weighted)  # every activation is a module too: replicas copy it


def test_the_launch_bound_mlp_learns_in_a_few_steps():
    torch.manual_seed(0)
    example = get_example("launch-bound")
    model = example.build_model()
    x, y, x_test, y_test = example.load_data(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        before = torch.nn.functional.cross_entropy(model(x_test), y_test)
    for step in range(60):
        rows = slice(32 * step, 32 * step + 32)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        optimizer.step()
    with torch.no_grad():
        after = torch.nn.functional.cross_entropy(model(x_test), y_test)
    assert after < 0.8 * before


def test_wide_blocks_weights_dominate_and_each_block_is_an_fsdp_unit():
    model = get_example("wide-blocks").build_model()
    parameters = sum(p.numel() for p in model.parameters())
    assert parameters * 4 > 25 * 2**20  # tens of MB of float32 weights
    assert shard_units(model) == list(model.blocks)  # fsdp's default rule: the ModuleList's blocks


def main_here(argv: list[str]) -> int:
    """`dpkit ARGV` in this process: in a launched group's process, as that rank of the command."""
    return main(argv)


@pytest.mark.slow
def test_wide_blocks_fsdp_keeps_at_most_0_6x_of_ddps_training_state_per_device(tmp_path, groups):
    state = {}
    for strategy in ("ddp", "fsdp"):
        out = tmp_path / f"{strategy}.json"
        argv = ["profile", "--example", "wide-blocks", "--strategy", strategy, "--accelerator", "cpu"]
        argv += ["--devices", "2", "--batch-size", "64", "--steps", "1", "--warmup", "1", "--no-progress"]
        # each rank of a launched group runs the profile, as `dpkit profile` runs it in the processes it starts
        assert groups(2).run(main_here, [*argv, "--json", str(out)]) == [0, 0]
        report = json.loads(out.read_text())
        assert len(report["devices"]) == 2
        # parameters, gradients and optimizer state at each device's peak, as the table shows them
        state[strategy] = max(
            sum(d["bytes_by_category"][c] for c in ("parameters", "gradients", "optimizer_state"))
            for d in report["devices"]
        )
    assert state["fsdp"] <= 0.6 * state["ddp"]
