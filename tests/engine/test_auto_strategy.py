"""strategy="auto" in the Engine and in `dpkit train`: the choice is said in one line, what it chose is what
runs (in every process it starts), and the Engine's own "auto" on several devices decides at the model's first call."""

from __future__ import annotations

import json

import pytest

from dpkit.cli.main import main
from dpkit.engine.engine import Engine
from dpkit.plan.auto import Choice
from dpkit.recipe import recipe


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


def test_the_engine_decides_what_needs_no_model_at_once_and_takes_a_choice_as_made(capsys):
    engine = Engine(strategy="auto", accelerator="cpu", devices=1, progress=False)
    assert engine.strategy.name == "single"
    engine.close()
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


def auto_loop(monkeypatch, chosen: str, devices: int = 3, steps: int = 3, decide_by=None):
    """A loop under Engine(strategy="auto") on `devices` virtual devices whose choice is injected (`chosen` on
    every device, or single on one); its weights after `steps` steps, the engine, what it printed."""
    import torch
    from torch import nn

    from dpkit.plan import auto as planner_auto

    asked = []

    def choose(model, sample, batch_size, devices_given, precision, optimizer, **options):
        asked.append((type(model).__name__, tuple(sample.shape), batch_size, len(devices_given), options))
        n = 1 if chosen == "single" else len(devices_given)
        return Choice(chosen, n, f"auto: {chosen} on {n} devices — injected", [], "test")

    monkeypatch.setattr(planner_auto, "choose_strategy", choose)  # the Engine imports it when it decides
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    engine = Engine(strategy="auto", accelerator="cpu", devices=devices, progress=False)
    assert engine.placement.undecided and engine.strategy.name == "single"  # the reference until the batch
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(7, 5, generator=generator), torch.randint(0, 3, (7,), generator=generator)
        optimizer.zero_grad()
        engine.backward(criterion(model(x), y))
        optimizer.step()
    return model.state_dict(), engine, asked


@pytest.mark.parametrize("chosen", ["single", "dp", "dp-balanced", "replicated"])
def test_the_engines_auto_on_several_devices_decides_at_the_first_batch_and_trains_as_the_choice(
    monkeypatch, capsys, chosen
):
    import torch

    weights, engine, asked = auto_loop(monkeypatch, chosen)
    assert asked == [("Sequential", (7, 5), 7, 3, asked[0][4])]  # once, from the model and the first batch
    assert asked[0][4]["can_launch"] is False and "ddp" not in asked[0][4]["strategies"]  # one process here
    assert "fsdp" not in asked[0][4]["strategies"]
    assert engine.strategy.name == chosen and len(engine.devices) == (1 if chosen == "single" else 3)
    assert capsys.readouterr().out.strip() == f"auto: {chosen} on {1 if chosen == 'single' else 3} devices — injected"
    engine.close()
    reference, _, _ = auto_loop(monkeypatch, "single")  # the same loop on one device: the same weights
    for name, value in weights.items():
        assert torch.allclose(value, reference[name], atol=1e-6), name


def test_the_engines_auto_resumes_with_the_strategy_the_state_was_saved_under(monkeypatch, capsys, tmp_path):
    import torch
    from torch import nn

    _, engine, _ = auto_loop(monkeypatch, "replicated", devices=2)
    engine.save_state(tmp_path)
    engine.close()
    capsys.readouterr()
    resumed = Engine(strategy="auto", accelerator="cpu", devices=2, progress=False)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    resumed.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    resumed.load_state(tmp_path)
    assert resumed.strategy.name == "replicated" and len(resumed.devices) == 2
    assert "auto: replicated on 2 device(s), the strategy the state in" in capsys.readouterr().out
    assert resumed.step == 3
    resumed.close()


def test_the_engines_auto_needs_a_batch_dimension_in_the_first_call(capsys):
    import torch
    from torch import nn

    engine = Engine(strategy="auto", accelerator="cpu", devices=2, progress=False)

    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return self.w * x

    model = engine.setup(Scalar())
    with pytest.raises(ValueError, match=r"^strategy: 'auto' chooses from the model's first batch"):
        model(torch.tensor(2.0))
    engine.close()


def test_the_engines_auto_on_a_real_model_prints_its_choice(capsys):
    import torch
    from torch import nn

    import dpkit

    model = nn.Sequential(*[layer for _ in range(20) for layer in (nn.Linear(32, 32), nn.ReLU())])
    expected = dpkit.choose_strategy(model, torch.randn(32, 32), 32, ["cpu:0", "cpu:1"], can_launch=False)
    capsys.readouterr()
    engine = Engine(strategy="auto", accelerator="cpu", devices=2, progress=False)
    model = engine.setup(model)
    model(torch.randn(32, 32))
    said = capsys.readouterr().out.strip().splitlines()
    assert said and said[0].startswith(f"auto: {expected.strategy}")
    assert engine.strategy.name == expected.strategy
    engine.close()
