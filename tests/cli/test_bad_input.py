"""Every bad input is one line naming the flag, the value and what is accepted; exit code 2; nothing
trained, nothing written, nothing overwritten."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from dpkit.cli.main import main

FACTORIES = textwrap.dedent("""
    import torch
    from torch import nn

    def not_a_module():
        return "a string"

    def raises():
        raise RuntimeError("no weights here")

    def tiny():
        return nn.Sequential(nn.Linear(64, 10))

    def wrong_width(seed):
        return (torch.randn(40, 5), torch.zeros(40, dtype=torch.long),
                torch.randn(8, 5), torch.zeros(8, dtype=torch.long))

    def float_labels(seed):
        return torch.randn(40, 64), torch.rand(40), torch.randn(8, 64), torch.rand(8)

    def two_items(seed):
        return torch.randn(40, 64), torch.zeros(40, dtype=torch.long)

    def rows_mismatch(seed):
        return (torch.randn(40, 64), torch.zeros(39, dtype=torch.long),
                torch.randn(8, 64), torch.zeros(8, dtype=torch.long))
""")


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "bad_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))


def snapshot(folder):
    """Every file under `folder` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def train(tmp_path, capsys, *argv, out=None):
    out = tmp_path / "run" if out is None else out
    code = main(["train", "--accelerator", "cpu", "--no-progress", "--steps", "2", "--out", str(out), *argv])
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines()


BAD = [
    (["--lr", "nan"], "--lr: expected a finite number > 0, got nan"),
    (["--lr", "inf"], "--lr: expected a finite number > 0, got inf"),
    (["--lr", "-0.1"], "--lr: expected a finite number > 0, got -0.1"),
    (["--momentum", "nan"], "--momentum: expected a finite number"),
    (["--seed", "-1"], "--seed: expected a seed from 0 to 4294967295 (2**32 - 1), got -1"),
    (["--seed", str(2**32)], "--seed: expected a seed from 0"),
    (["--steps", "0"], "--steps: expected a positive int, got 0"),
    (["--checkpoint-every", "0"], "--checkpoint-every: expected a positive int, got 0"),
    (["--keep", "0"], "--keep: expected a positive int, got 0"),
    (["--batch-size", "100000"], "--batch-size: 100000 is larger than the 1437 training rows; use at most 1437"),
    (["--strategy", "dp", "--devices", "0,1"], "--devices: '0,1' names cuda devices but --accelerator cpu"),
    (
        ["--strategy", "dp", "--devices", "cuda:0,cuda:1"],
        "--devices: 'cuda:0,cuda:1' names cuda devices but --accelerator cpu",
    ),
    (["--strategy", "dp", "--devices", "1000"], "--devices: 1000 devices is past torch's limit of 128"),
    (["--strategy", "replicated", "--devices", "130"], "--devices: 130 devices is past torch's limit of 128"),
    (
        ["--strategy", "dp", "--devices", "cpu:0,cpu:200"],
        "--devices[1]: device index 200 in 'cpu:200' is past torch's limit of 127",
    ),
    (["--strategy", "ddp", "--devices", "100"], "--devices: 100 processes on"),
    (
        ["--strategy", "single", "--devices", "2"],
        "--devices: strategy 'single' runs on 1 device(s), got 2; to train on 2 devices pass a strategy for "
        "several (dp, ",
    ),
    (["--hang-timeout", "nan"], "--hang-timeout: expected a finite number"),
    (["--resume", "--overwrite"], "--resume/--overwrite: give one"),
    (["--resume"], "--resume: no saved state in"),
    (
        ["--model", "bad_factories:not_a_module"],
        "--model: bad_factories:not_a_module() returned str, expected a torch.nn.Module",
    ),
    (["--model", "bad_factories:raises"], "--model: bad_factories:raises() raised RuntimeError: no weights here"),
    (["--model", "no_such_module:build"], "cannot import 'no_such_module'"),
    (["--data", "bad_factories:wrong_width", "--batch-size", "8"], "--data: the model cannot take rows of shape (5,)"),
    (
        ["--data", "bad_factories:float_labels", "--batch-size", "8"],
        "--data: bad_factories:float_labels(seed) gave y_train of dtype torch.float32",
    ),
    (
        ["--data", "bad_factories:two_items", "--batch-size", "8"],
        "--data: bad_factories:two_items(seed) returned 2 item(s)",
    ),
    (
        ["--data", "bad_factories:rows_mismatch", "--batch-size", "8"],
        "x_train of shape (40, 64) and y_train of shape (39,)",
    ),
    (
        ["--model", "bad_factories:tiny", "--data", "bad_factories:two_items"],
        "--data: bad_factories:two_items(seed) returned 2 item(s)",
    ),
    (["--example", "imagenet"], "--example: unknown example 'imagenet'"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(argv) for argv, _ in BAD])
def test_a_bad_flag_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, factories, argv, message):
    code, lines = train(tmp_path, capsys, *argv)
    assert code == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith("dpkit train: error: ") and message in lines[0], lines[0]
    assert not (tmp_path / "run").exists()  # nothing trained, no folder made


def test_out_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("mine")
    code, lines = train(tmp_path, capsys, out=target)
    assert code == 2 and lines == [
        f"dpkit train: error: --out: {str(target)!r} is a file, expected a folder (existing or to create)"
    ]
    assert target.read_text() == "mine"
    code, lines = train(tmp_path, capsys, out=target / "below")
    assert code == 2 and len(lines) == 1 and "cannot be created" in lines[0]


def test_out_that_is_not_writable(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.geteuid() == 0:  # root writes anywhere: let the permission check see what a user would
        real_access = os.access
        monkeypatch.setattr(
            os, "access", lambda path, mode: False if os.path.abspath(path) == str(locked) else real_access(path, mode)
        )
    try:
        code, lines = train(tmp_path, capsys, out=locked / "run")
    finally:
        locked.chmod(0o700)
    assert code == 2 and lines == [
        f"dpkit train: error: --out: {str(locked / 'run')!r} cannot be created: {str(locked)!r} "
        "is not writable; choose a folder you can write to"
    ]
    assert not (locked / "run").exists()


def test_an_existing_run_is_refused_before_training_and_kept(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--accelerator", "cpu", "--no-progress", "--steps", "2", "--out", str(out)]) == 0
    before = snapshot(out)
    capsys.readouterr()
    code, lines = train(tmp_path, capsys, "--lr", "0.5")
    assert code == 2 and len(lines) == 1
    assert (
        f"--out: {str(out)!r} already holds a run" in lines[0] and "--resume" in lines[0] and "--overwrite" in lines[0]
    )
    assert snapshot(out) == before
    # --overwrite replaces the run's files and leaves the user's own files alone
    (out / "notes.txt").write_text("keep me")
    assert (
        main(
            [
                "train",
                "--accelerator",
                "cpu",
                "--no-progress",
                "--steps",
                "2",
                "--lr",
                "0.5",
                "--out",
                str(out),
                "--overwrite",
            ]
        )
        == 0
    )
    assert json.loads((out / "metrics.json").read_text())["lr"] == 0.5
    assert (out / "notes.txt").read_text() == "keep me"


def test_resume_with_other_settings_names_the_flag(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--accelerator",
                "cpu",
                "--no-progress",
                "--steps",
                "2",
                "--checkpoint-every",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    before = snapshot(out)
    capsys.readouterr()
    code, lines = train(tmp_path, capsys, "--steps", "4", "--resume", "--batch-size", "32")
    assert code == 2 and lines == [
        f"dpkit train: error: --batch-size: the run in {str(out)!r} was trained with 64, got 32; "
        "resume with the same value"
    ]
    assert snapshot(out) == before


def test_a_loss_that_becomes_nan_stops_the_run_with_one_line_and_no_nan_on_disk(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--accelerator", "cpu", "--no-progress", "--steps", "30", "--lr", "1e6", "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 3
    assert len(lines) == 1 and lines[0].startswith("dpkit train: error: --lr: the loss became nan at step "), lines
    assert "with --lr 1e+06;" in lines[0] and lines[0].endswith("try a smaller lr or --clip-grad-norm 1")
    assert not out.exists() or not any(out.iterdir())  # nothing written from a diverged model


def test_json_naming_a_folder_is_refused_before_profiling(tmp_path, capsys):
    code = main(["profile", "--accelerator", "cpu", "--no-progress", "--json", str(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and lines == [
        f"dpkit profile: error: --json: {str(tmp_path)!r} is a folder, expected a file name "
        f"(e.g. {str(tmp_path / 'report.json')!r})"
    ]


def test_launch_refuses_more_processes_than_the_cores_carry(capsys):
    code = main(["launch", "--nproc-per-node", "1000", "script.py"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--nproc-per-node: 1000 processes on" in lines[0] and "--force" in lines[0]


def test_resume_of_a_finished_run_names_steps(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--accelerator",
                "cpu",
                "--no-progress",
                "--steps",
                "2",
                "--checkpoint-every",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    before = snapshot(out)
    capsys.readouterr()
    # fewer steps than the run took is bad input (a finished run resumed with its own --steps exits 0:
    # tests/recipe/test_recipe_faults.py)
    code, lines = train(tmp_path, capsys, "--checkpoint-every", "1", "--resume", "--steps", "1")
    assert code == 2 and lines == [
        f"dpkit train: error: --steps: the run in {str(out)!r} has already taken 2 steps; "
        "give 2 to finish it or more to continue it"
    ]
    assert snapshot(out) == before
