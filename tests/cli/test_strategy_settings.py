"""zero's stage and hsdp's shard groups from `dpkit train` (issue 43): `--zero-stage {1,2}` and `--shard-size N`,
refused in one line with a strategy that lacks them, and named in the start line and by `dpkit ckpt inspect`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dpkit.cli.main import main as dpkit_main

CPU = ["--accelerator", "cpu", "--no-progress"]


@pytest.mark.parametrize(
    "flags,said",
    [
        (["--strategy", "ddp", "--devices", "2", "--zero-stage", "2"], "--zero-stage: strategy 'ddp' has no stage"),
        (["--strategy", "fsdp", "--devices", "2", "--shard-size", "1"], "--shard-size: strategy 'fsdp' has no shard"),
        (["--strategy", "hsdp", "--devices", "4", "--shard-size", "3"], "--shard-size: 3 processes per shard group"),
        (["--strategy", "zero", "--devices", "2", "--zero-stage", "3"], "--zero-stage: invalid choice: 3"),
    ],
)
def test_a_setting_the_strategy_lacks_is_refused_before_any_work(flags, said, tmp_path, capsys):
    assert dpkit_main(["train", *CPU, *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert not (tmp_path / "run").exists()


def test_hsdp_on_four_processes_in_shard_groups_of_two_says_its_mesh_and_the_state_keeps_it(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "dpkit.cli.main", "train", *CPU, "--strategy", "hsdp", "--devices", "4"]
    command += ["--shard-size", "2", "--steps", "2", "--checkpoint-every", "2", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "with strategy hsdp 2x2 (replicate x shard) on 4 process(es)" in result.stdout + result.stderr
    inspected = subprocess.run(
        [sys.executable, "-m", "dpkit.cli.main", "ckpt", "inspect", str(out / "state")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "strategy hsdp 2x2 (replicate x shard) on 4 process(es)" in inspected.stdout, inspected.stdout


def test_the_start_line_says_what_a_step_takes_under_accumulate(tmp_path, capsys):
    argv = ["train", *CPU, "--batch-size", "8", "--accumulate", "4", "--steps", "1", "--out", str(tmp_path / "run")]
    assert dpkit_main(argv) == 0
    said = capsys.readouterr()
    assert "global batch 8 x 4 micro-batches = 32 samples per step" in said.out + said.err


def test_zero_stage_2_from_the_command_line_is_stage_2(tmp_path):
    command = [sys.executable, "-m", "dpkit.cli.main", "train", *CPU, "--strategy", "zero", "--devices", "2"]
    command += ["--zero-stage", "2", "--steps", "1", "--out", str(tmp_path / "run")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "with strategy zero stage 2 on 2 process(es)" in result.stdout + result.stderr
