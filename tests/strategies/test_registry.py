"""The registry is the only list of strategies, and what a strategy is lives in its traits: nothing outside
strategies/ compares a strategy's name, and a strategy added to the registry reaches every verb."""

from __future__ import annotations

import ast
import dataclasses
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
from dpkit.strategies.per_device import ProcessGroupOptions


def constructor_options(cls: type) -> set[str]:
    """The keywords cls(devices, ...) takes: its constructor's own and, where it passes **options on, those of the
    constructors along its bases, down to the process group's options value (declared once, process_group.py)."""
    accepted: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameters = inspect.signature(init).parameters.values()
        accepted |= {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            return accepted - {"self", "devices"}
        if klass.__name__ == "PerDeviceStrategy":
            return (accepted | {field.name for field in dataclasses.fields(ProcessGroupOptions)}) - {"self", "devices"}
    return accepted - {"self", "devices"}


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
        accepted = constructor_options(cls) - {"precision"}
        assert set(cls.options) == accepted, (
            f"{name}: options {cls.options} but the constructor takes {sorted(accepted)}"
        )


def test_the_reference_is_the_one_one_device_strategy():
    assert matching(lambda traits: traits.max_devices == 1) == [reference()]
    assert strategy_class(reference()).traits.replicas == NO_REPLICAS


def test_an_unknown_name_or_option_is_a_clear_error():
    with pytest.raises(ValueError, match="strategy: unknown strategy 'nonesuch'; choose one of single, dp"):
        strategy_class("nonesuch")
    with pytest.raises(TypeError, match="seed: not an option of strategy 'dp' \\(its options: concurrency\\)"):
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
    from dpkit.plan.configuration import Hardware
    from dpkit.plan.cost_model import predict
    from dpkit.plan.profiles import builtin_profile
    from dpkit.tools.bench.spec import BenchSpec

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


# ---- what a strategy shards, as data ----------------------------------------------------------------------------


def test_traits_say_what_is_sharded_over_which_group():
    from dpkit.strategies import ALL_PROCESSES, FOR_THE_STEP, ONE_NODE, PER_UNIT, SHARDED, WHOLE, strategy_traits

    ddp, fsdp = strategy_class("ddp").traits, strategy_class("fsdp").traits
    assert (ddp.weights, ddp.gradients, ddp.optimizer_state) == (WHOLE, WHOLE, WHOLE) and not ddp.sharded
    assert fsdp.sharded_parts == ("weights", "gradients", "optimizer_state") and fsdp.sharded
    assert fsdp.gathers == PER_UNIT and fsdp.shard_group == ALL_PROCESSES
    # an option that changes them: the planner asks the class, without building the strategy
    assert strategy_traits("fsdp", reshard_after_forward=False).gathers == FOR_THE_STEP
    assert strategy_traits("fsdp") == fsdp
    with pytest.raises(TypeError, match="stage: not an option of strategy 'fsdp'"):
        strategy_traits("fsdp", stage=2)
    # the shard group's size in a run of 8 processes, 4 per node
    optimizer_only = Traits(PER_DEVICE, ON_ROOT, PERSISTENT, optimizer_state=SHARDED)
    assert optimizer_only.sharded_parts == ("optimizer_state",) and optimizer_only.sharded
    assert optimizer_only.shard_size(8, 4) == 8
    assert Traits(PER_DEVICE, ON_ROOT, PERSISTENT, optimizer_state=SHARDED, shard_group=ONE_NODE).shard_size(8, 4) == 4
    assert Traits(PER_DEVICE, ON_ROOT, PERSISTENT, optimizer_state=SHARDED, shard_group=2).shard_size(8, 4) == 2
    assert ddp.shard_size(8, 4) == 1  # nothing sharded: a group of one


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"weights": "half"}, "weights: expected 'whole' or 'sharded', got 'half'"),
        ({"optimizer_state": True}, "optimizer_state: expected 'whole' or 'sharded', got True"),
        ({"weights": "sharded"}, "gathers: sharded weights are gathered"),
        ({"gathers": "per-unit"}, "gathers: sharded weights are gathered .* got weights='whole', gathers='per-unit'"),
        ({"gathers": "sometimes"}, "gathers: expected 'none', 'per-unit' or 'step', got 'sometimes'"),
        ({"shard_group": 0}, "shard_group: expected 'all', 'node' or a positive number of processes, got 0"),
        ({"shard_group": "rack"}, "shard_group: .* got 'rack'"),
    ],
)
def test_traits_refuse_what_they_cannot_mean(changes, message):
    with pytest.raises(ValueError, match=message):
        Traits(PER_DEVICE, ON_ROOT, PERSISTENT, **changes)


def test_a_mesh_is_replicate_groups_by_shard_groups():
    from dpkit.strategies.mesh import mesh_shape

    assert mesh_shape(4, 4) == (1, 4) and mesh_shape(4, 2) == (2, 2) and mesh_shape(8, 1) == (8, 1)
    with pytest.raises(ValueError, match="shard_size: 3 processes per shard group do not divide the 4 processes"):
        mesh_shape(4, 3)
    with pytest.raises(ValueError, match="shard_size: 8 processes per shard group do not divide the 4"):
        mesh_shape(4, 8)
    with pytest.raises(ValueError, match="shard_size: expected a positive int"):
        mesh_shape(4, 0)


def test_every_strategys_planned_variants_are_options_the_planner_can_read():
    # the planner predicts each variant from strategy_traits(name, **options), without building the strategy
    from dpkit.strategies import strategy_traits

    for name in available_strategies():
        cls = strategy_class(name)
        assert strategy_traits(name) == cls.traits, name
        for variant in cls.planned_variants:
            assert set(variant) <= set(cls.options), (name, variant)
            assert isinstance(strategy_traits(name, **variant), Traits), (name, variant)
