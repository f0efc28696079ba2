"""The registry is the only list of strategies, and what a strategy is lives in its traits: nothing outside
strategies/ compares a strategy's name, and a strategy added to the registry reaches every verb."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest

import dpkit
from dpkit import strategies
from dpkit.strategies import (
    IN_REPLICAS,
    NO_REPLICAS,
    ON_ROOT,
    ONE_PROCESS,
    PER_DEVICE,
    PER_STEP,
    PERSISTENT,
    Traits,
    available_strategies,
    matching,
    reference,
    strategy_class,
)
from dpkit.strategies.dp import DP

PACKAGE = Path(dpkit.__file__).parent


def test_every_registered_strategy_declares_what_it_is():
    for name in available_strategies():
        cls = strategy_class(name)
        assert cls.name == name
        traits = cls.traits
        assert isinstance(traits, Traits)
        assert traits.processes in (ONE_PROCESS, PER_DEVICE)
        assert traits.loss in (ON_ROOT, IN_REPLICAS)
        assert traits.replicas in (NO_REPLICAS, PER_STEP, PERSISTENT)
        # precision is every strategy's (the run's), given by create_strategy; options are the strategy's own
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "devices", "precision"}
        assert set(cls.options) == accepted, (
            f"{name}: options {cls.options} but the constructor takes {sorted(accepted)}"
        )


def test_the_reference_is_the_one_one_device_strategy():
    assert matching(lambda traits: traits.max_devices == 1) == [reference()]
    assert strategy_class(reference()).traits.replicas == NO_REPLICAS


def test_an_unknown_name_or_option_is_a_clear_error():
    with pytest.raises(ValueError, match="strategy: unknown strategy 'zero'; choose one of single, dp"):
        strategy_class("zero")
    with pytest.raises(TypeError, match="seed: not an option of strategy 'dp' \\(its options: none\\)"):
        strategies.create_strategy("dp", dpkit.cpu_devices(2), seed=3)


def _compared_names(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines where a string equal to a strategy's name is compared (==, !=, in, not in)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for operand in [node.left, *node.comparators]:
            items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            if any(isinstance(item, ast.Constant) and item.value in names for item in items):
                lines.append(node.lineno)
    return lines


def test_no_strategy_name_is_compared_outside_strategies():
    names = set(available_strategies())
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "strategies":
            continue
        for line in _compared_names(ast.parse(path.read_text()), names):
            offences.append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    assert not offences, "strategy names compared outside strategies/ (ask the traits): " + ", ".join(offences)


def test_the_name_check_sees_equality_and_membership():
    tree = ast.parse("a == 'dp'\nb in ('single', 'x')\nc != 'ddp'\nd == 'other'\n")
    assert _compared_names(tree, {"dp", "single", "ddp"}) == [1, 2, 3]


class DPCopy(DP):
    """A new strategy as a user would add one: its own name, traits like dp's."""

    name = "dp-copy"


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(strategies.STRATEGIES, DPCopy.name, f"{__name__}:DPCopy")
    return DPCopy.name


def test_a_strategy_added_to_the_registry_reaches_train_bench_and_plan(registered, tmp_path):
    from dpkit.cli.main import main
    from dpkit.plan.catalogue import Catalogue
    from dpkit.plan.cost_model import Hardware, predict
    from dpkit.plan.profiles import builtin_profile
    from dpkit.tools.bench import BenchSpec

    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--strategy",
                registered,
                "--accelerator",
                "cpu",
                "--devices",
                "2",
                "--steps",
                "2",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    assert json.loads((out / "metrics.json").read_text())["strategy"] == registered
    assert registered in BenchSpec().strategies
    catalogue = Catalogue.load()
    hardware = Hardware(catalogue.gpu("h100-sxm"), catalogue.link("pcie4"))
    mine, dp = (predict(builtin_profile("resnet50"), hardware, name, 4, 32) for name in (registered, "dp"))
    assert mine.breakdown == dp.breakdown and mine.peak_bytes_per_device == dp.peak_bytes_per_device
