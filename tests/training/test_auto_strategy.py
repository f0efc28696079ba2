"""strategy="auto" in the Engine and in `dpkit train`: the choice is said in one line, what it chose is what
runs (in every process it starts), and the Engine asks for the model where the choice depends on it."""

from __future__ import annotations

import json

import pytest

from dpkit.cli.main import main
from dpkit.plan.auto import Choice
from dpkit.training import recipe
from dpkit.training.engine import Engine


def train(tmp_path, capsys, *argv):
    code = main(["train", "--accelerator", "cpu", "--no-progress", "-q", "--steps", "3", "--out", str(tmp_path), *argv])
    return code, capsys.readouterr()


def test_several_devices_without_a_strategy_choose_one_and_say_why(tmp_path, capsys):
    code, said = train(tmp_path, capsys, "--example", "launch-bound", "--devices", "2", "--batch-size", "32")
    assert code == 0
    first = said.out.splitlines()[0]
    assert first.startswith("dpkit train: auto: "), said.out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    chosen = first.split("auto: ")[1].split()[0]
    assert metrics["strategy"] == chosen  # what it said is what ran
    # on a model whose step is launches, one device (or a reason for more) is the answer
    assert chosen == "single" or "single's throughput" in first


def test_the_processes_a_run_starts_take_the_choice_as_made(tmp_path, capsys, monkeypatch):
    def choose(model, inputs, batch_size, devices, **options):
        assert options["can_launch"] and len(devices) == 2 and batch_size == 64
        return Choice("ddp", 2, "auto: ddp on 2 devices — injected", [], "test")

    monkeypatch.setattr(recipe, "choose_strategy", choose)  # the workers cannot see this: they read the choice
    code, said = train(tmp_path, capsys, "--devices", "2", "--strategy", "auto")
    assert code == 0 and said.out.splitlines()[0] == "dpkit train: auto: ddp on 2 devices — injected"
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["strategy"] == "ddp" and metrics["world_size"] == 2


def test_one_device_or_the_default_devices_stay_single(tmp_path, capsys):
    code, said = train(tmp_path, capsys, "--devices", "1")
    assert code == 0 and "auto:" not in said.out
    assert json.loads((tmp_path / "metrics.json").read_text())["strategy"] == "single"


def test_the_engine_decides_what_needs_no_model_and_asks_for_the_model_otherwise(capsys):
    engine = Engine(strategy="auto", accelerator="cpu", devices=1, progress=False)
    assert engine.strategy.name == "single"
    engine.close()
    with pytest.raises(ValueError, match=r"^strategy: 'auto' on 2 devices in one process decides from the model"):
        Engine(strategy="auto", accelerator="cpu", devices=2, progress=False)
    choice = Choice("replicated", 2, "auto: replicated on 2 devices — injected", [], "test")
    engine = Engine(strategy=choice, accelerator="cpu", devices=2, progress=False)
    assert engine.strategy.name == "replicated" and len(engine.devices) == 2
    assert capsys.readouterr().out.strip() == "auto: replicated on 2 devices — injected"
    engine.close()
    one = Choice("single", 1, "auto: single — injected", [], "test")
    engine = Engine(strategy=one, accelerator="cpu", devices=2, progress=False)
    assert engine.strategy.name == "single" and [str(d) for d in engine.devices] == ["cpu:0"]
    engine.close()


def test_choose_strategy_with_the_engine_on_a_real_model():
    import torch
    from torch import nn

    import dpkit

    model = nn.Sequential(*[layer for _ in range(20) for layer in (nn.Linear(32, 32), nn.ReLU())])
    choice = dpkit.choose_strategy(model, torch.randn(32, 32), 32, ["cpu:0", "cpu:1"], can_launch=False)
    engine = dpkit.Engine(strategy=choice, accelerator="cpu", devices=2, progress=False)
    assert engine.strategy.name == choice.strategy and len(engine.devices) == choice.devices
    engine.close()
