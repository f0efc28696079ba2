"""The first things a user types: `dpkit`, `--version`, -v / -q on either side of the verb, a model factory in
the current folder, and a demo that exits 0 when it ran."""

from __future__ import annotations

import sys

import pytest

from dpkit.cli.main import main


def test_plain_dpkit_prints_the_overview_and_version_says_which(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dpkit") and "train" in out and "plan" in out
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("dpkit ")


@pytest.mark.parametrize("argv", [["-q", "ckpt", "inspect"], ["ckpt", "inspect", "-q"], ["ckpt", "-v", "inspect"]])
def test_log_level_flags_go_before_or_after_the_verb(argv, tmp_path, capsys):
    import torch

    torch.save({"w": torch.zeros(2)}, tmp_path / "m.pt")
    assert main([*argv, str(tmp_path / "m.pt")]) == 0
    assert "w" in capsys.readouterr().out


def test_a_model_factory_in_the_current_folder_needs_no_pythonpath(tmp_path, monkeypatch, capsys):
    (tmp_path / "frontdoor_models.py").write_text(
        "from torch import nn\n\n\ndef build():\n"
        "    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    argv = ["train", "--model", "frontdoor_models:build", "--accelerator", "cpu", "--steps", "2", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "model.pt").is_file()


def test_the_demo_exits_0_when_it_ran_and_notes_a_low_accuracy_in_one_line(tmp_path, capsys):
    argv = ["demo", "--accelerator", "cpu", "--devices", "3", "--epochs", "1", "--no-progress", "--no-compare"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "below 0.95" in notes[0] and "--epochs" in notes[0]
