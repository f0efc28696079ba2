"""Where a run runs is resolved once into a frozen Placement (engine/placement.py): from the arguments and the
launch environment, equal to what the strategy was built with, and never read again from the environment."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import dpkit
from dpkit.engine import placement as placement_module
from dpkit.engine.engine import Engine
from dpkit.engine.placement import Placement, resolve_placement
from dpkit.launch.network import free_port
from dpkit.plan.auto import Choice

CPU = [torch.device("cpu", index) for index in range(4)]


def launched_as(monkeypatch, rank, world_size, local_rank, local_world_size, node_rank=None):
    """This process's environment as a launcher sets it for one of its workers."""
    values = {
        "RANK": rank,
        "WORLD_SIZE": world_size,
        "LOCAL_RANK": local_rank,
        "LOCAL_WORLD_SIZE": local_world_size,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": free_port(),
    }
    if node_rank is not None:
        values["GROUP_RANK"] = node_rank
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


def not_launched(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_a_worker_of_a_launched_group_is_placed_from_the_arguments_and_its_launch_environment(monkeypatch):
    launched_as(monkeypatch, rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1)
    placed = resolve_placement("ddp", "cpu", 2, "bf16-mixed")
    assert placed == Placement(
        "ddp", tuple(CPU[:2]), processes=4, rank=3, local_rank=1, node_rank=1, precision="bf16-mixed"
    )
    assert placed.device == CPU[1] and placed.per_device and not placed.undecided
    # "auto" under a launcher with several processes: one process per device
    assert resolve_placement("auto", "cpu", 2).strategy == "ddp"


def test_a_one_process_strategy_is_rank_0_of_1_wherever_it_runs(monkeypatch):
    launched_as(monkeypatch, rank=1, world_size=2, local_rank=1, local_world_size=2)
    placed = resolve_placement("replicated", "cpu", 3)
    assert (placed.processes, placed.rank, placed.local_rank, placed.node_rank) == (1, 0, 0, 0)
    assert placed.devices == tuple(CPU[:3]) and placed.device == CPU[0]


def test_auto_in_one_process_runs_the_reference_until_it_decides(monkeypatch):
    not_launched(monkeypatch)
    assert resolve_placement("auto", "cpu", 1) == Placement("single", (CPU[0],))
    placed = resolve_placement("auto", "cpu", 3)
    assert placed == Placement("single", (CPU[0],), auto_devices=tuple(CPU[:3])) and placed.undecided
    decided = placed.decided("replicated", CPU[:2])
    assert decided == Placement("replicated", tuple(CPU[:2])) and not decided.undecided
    assert placed.undecided  # a decision is a new placement; the old one is unchanged


def test_a_choice_is_placed_on_the_devices_it_chose(monkeypatch):
    not_launched(monkeypatch)
    assert resolve_placement(Choice("single", 1, "why", [], "test"), "cpu", 3).devices == (CPU[0],)
    assert resolve_placement(Choice("dp", 3, "why", [], "test"), "cpu", 3) == Placement("dp", tuple(CPU[:3]))


def test_devices_auto_is_the_most_a_strategy_runs_on(monkeypatch):
    not_launched(monkeypatch)
    assert resolve_placement("single", "cpu", "auto").devices == (CPU[0],)


@pytest.mark.parametrize(
    "arguments,message",
    [
        (("horovod", "cpu", 2), r"^strategy: unknown strategy 'horovod'; choose one of single, dp"),
        (("single", "cpu", 1, "fp8"), r"^precision: expected one of '32', 'bf16-mixed', '16-mixed', got 'fp8'$"),
        (("single", "tpu", 1), r"^accelerator: expected 'auto', 'cpu' or 'cuda', got 'tpu'$"),
    ],
)
def test_bad_arguments_are_one_line_naming_the_argument(monkeypatch, arguments, message):
    not_launched(monkeypatch)
    with pytest.raises(ValueError, match=message):
        resolve_placement(*arguments)


def test_a_placement_is_frozen(monkeypatch):
    not_launched(monkeypatch)
    placed = resolve_placement("dp", "cpu", 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        placed.rank = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        placed.strategy = "ddp"  # type: ignore[misc]


@pytest.mark.parametrize("strategy,devices", [("single", 1), ("dp", 2), ("replicated", 3)])
def test_the_engine_resolves_its_placement_once_and_builds_its_strategy_from_it(monkeypatch, strategy, devices):
    not_launched(monkeypatch)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return resolve_placement(*args, **kwargs)

    monkeypatch.setattr("dpkit.engine.engine.resolve_placement", counted)
    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, precision="bf16-mixed", progress=False)
    placed = engine.placement
    assert calls == [(strategy, "cpu", devices, "bf16-mixed")]
    built = engine.strategy
    assert (built.name, tuple(built.devices), built.precision) == (placed.strategy, placed.devices, placed.precision)
    assert (built.rank, built.world_size, built.root_device) == (placed.rank, placed.processes, placed.device)
    # a loop, a save and a load later, nothing was resolved again (a launch variable set now changes nothing)
    monkeypatch.setenv("RANK", "5")
    model = nn.Linear(3, 2)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.backward(model(torch.randn(6, 3)).sum())
    optimizer.step()
    assert len(calls) == 1 and engine.placement is placed and (engine.rank, engine.world_size) == (0, 1)
    engine.close()


def test_the_engine_under_a_launcher_has_the_placement_its_ddp_strategy_got(monkeypatch):
    launched_as(monkeypatch, rank=0, world_size=1, local_rank=0, local_world_size=1)
    engine = Engine(strategy="ddp", accelerator="cpu", devices=1, progress=False)
    try:
        placed, built = engine.placement, engine.strategy
        assert placed == Placement("ddp", (CPU[0],), processes=1, rank=0, local_rank=0, node_rank=0)
        assert (built.rank, built.world_size, built.local_rank, built.root_device) == (0, 1, 0, placed.device)
    finally:
        engine.close()


def test_the_engines_auto_replaces_its_placement_by_the_decided_one(monkeypatch, capsys):
    not_launched(monkeypatch)

    def choose(model, sample, batch_size, devices, precision, optimizer, **options):
        return Choice("dp", 2, "auto: dp on 2 devices — injected", [], "test")

    monkeypatch.setattr("dpkit.plan.auto.choose_strategy", choose)
    engine = Engine(strategy="auto", accelerator="cpu", devices=3, progress=False)
    before = engine.placement
    model = nn.Linear(3, 2)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.backward(model(torch.randn(6, 3)).sum())
    optimizer.step()
    assert before == Placement("single", (CPU[0],), auto_devices=tuple(CPU[:3]))  # unchanged: frozen
    assert engine.placement == Placement("dp", tuple(CPU[:2])) and engine.strategy.name == "dp"
    assert tuple(engine.strategy.devices) == engine.placement.devices
    assert capsys.readouterr().out.strip() == "auto: dp on 2 devices — injected"
    engine.close()


LAUNCH_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"}


def test_no_module_of_the_training_floor_reads_the_launch_variables():
    """They are read in dpkit.launch only (environment.process_place); the training floor gets a Placement."""
    folder = Path(dpkit.__file__).parent / "training"
    readers = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in LAUNCH_VARIABLES:
                readers.append(f"{path.name}:{node.lineno} {node.value}")
    assert readers == []
    assert placement_module.process_place.__module__ == "dpkit.launch.environment"
