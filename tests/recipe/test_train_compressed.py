"""`dpkit train --compress` (issue 44): PowerSGD's state resumes bit for bit through `--resume`, metrics.json counts
the bytes that crossed, and a compression a strategy cannot take is refused in one line before anything starts."""

from __future__ import annotations

import json

import pytest
import torch
from recipe_runs import train_here

from dpkit.cli.main import main as dpkit_main

CPU = ["--accelerator", "cpu", "--no-progress"]
DDP = ["--strategy", "ddp", "--devices", "2", *CPU, "--compress", "powersgd:2", "--compress-warmup", "5"]


def test_fourteen_steps_then_a_resume_to_thirty_equal_thirty_in_one_go(tmp_path, groups):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for argv in (
        [*DDP, "--steps", "30", "--out", str(whole)],
        [*DDP, "--steps", "14", "--checkpoint-every", "14", "--out", str(parts)],
        [*DDP, "--steps", "30", "--out", str(parts), "--resume"],
    ):
        results = groups(2).run(train_here, argv)
        assert [code for code, _ in results] == [0, 0], results
    assert "compress powersgd:2 from step 5" in results[0][1]
    one_go, resumed = torch.load(whole / "model.pt"), torch.load(parts / "model.pt")
    assert all(torch.equal(one_go[k], resumed[k]) for k in one_go)
    metrics = json.loads((whole / "metrics.json").read_text())
    assert metrics["compress"] == "powersgd:2" and metrics["communication_bytes"] > 0


def test_metrics_count_the_bytes_that_would_cross(tmp_path):
    sent = {}
    for compress in ("none", "bf16"):
        out = tmp_path / compress
        argv = ["train", "--strategy", "replicated", "--devices", "2", *CPU, "--steps", "4", "--compress", compress]
        assert dpkit_main([*argv, "--out", str(out)]) == 0
        sent[compress] = json.loads((out / "metrics.json").read_text())["communication_bytes"]
    assert sent["none"] == 2 * sent["bf16"] > 0


@pytest.mark.parametrize(
    "flags,said",
    [
        (["--strategy", "ddp", "--devices", "2", "--compress", "zip"], "--compress: expected none, bf16, fp16"),
        (["--strategy", "ddp", "--devices", "2", "--compress", "powersgd:0"], "--compress: the rank of 'powersgd:0'"),
        (
            ["--strategy", "fsdp", "--devices", "2", "--compress", "powersgd"],
            "--compress: strategy 'fsdp' reduce-scatters gradients to their shards and takes bf16 or fp16 only",
        ),
        (["--strategy", "dp", "--devices", "2", "--compress", "bf16"], "--compress: strategy 'dp' has no gradient"),
        (["--devices", "2", "--compress", "bf16"], "--compress: 'bf16' goes with a strategy named for it"),
    ],
)
def test_a_compression_the_run_cannot_take_is_one_line_before_anything_starts(flags, said, tmp_path, capsys):
    assert dpkit_main(["train", *CPU, *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dpkit train: error: {said}") and "\n" not in err, err
    assert not (tmp_path / "run").exists()
