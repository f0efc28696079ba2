"""`dpkit train`: outputs, a user model factory, and argument errors."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from dpkit.cli.main import main
from dpkit.examples.digits import DigitsMLP

FACTORY = textwrap.dedent("""
    from torch import nn

    def tiny():
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
""")


def test_writes_a_clean_model_and_metrics(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--strategy", "replicated", "--accelerator", "cpu", "--devices", "2", "--steps", "4",
                 "--batch-size", "33", "--seed", "1", "--lr", "0.05", "--out", str(out), "--no-progress"]) == 0
    model = DigitsMLP()
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["strategy"] == "replicated" and metrics["devices"] == ["cpu:0", "cpu:1"]
    assert len(metrics["loss"]) == 4 and all(loss > 0 for loss in metrics["loss"])
    assert metrics["samples_per_second"] > 0 and metrics["batch_size"] == 33


def test_accumulate_counts_optimizer_steps(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--strategy", "dp", "--accelerator", "cpu", "--devices", "2", "--steps", "3", "--accumulate", "2",
                 "--batch-size", "16", "--out", str(out), "--no-progress"]) == 0
    assert len(json.loads((out / "metrics.json").read_text())["loss"]) == 3


def test_a_user_model_factory(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    assert main(["train", "--model", "my_models:tiny", "--strategy", "dp", "--accelerator", "cpu", "--devices", "2",
                 "--steps", "3", "--out", str(out), "--no-progress"]) == 0
    state = torch.load(out / "model.pt", weights_only=True)
    assert list(state) == ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps: expected at least 1"),
    (["--batch-size", "0"], "--batch-size: expected at least 1"),
    (["--example", "imagenet"], "--example: unknown example 'imagenet'"),
    (["--model", "no_such_module:build"], "cannot import 'no_such_module'"),
    (["--strategy", "single", "--devices", "2"], "devices=1"),
])
def test_errors_name_the_argument(tmp_path, capsys, argv, message):
    assert main(["train", "--accelerator", "cpu", "--out", str(tmp_path), "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err
