"""`dpkit train --data package.module:streams` with a per-process stream factory (issue 45): each process trains on
its own batches, the run finishes although the ranks' streams end apart, and the evaluation counts every test sample
once; a strategy without a process per device refuses such data in one line."""

from __future__ import annotations

import json

from recipe_runs import train_here
from stream_data import TEST_ROWS

from dpkit.cli.main import main as dpkit_main


def test_a_per_process_stream_factory_trains_and_evaluates_every_sample_once(tmp_path, groups):
    out = tmp_path / "run"
    argv = ["--strategy", "ddp", "--devices", "2", "--accelerator", "cpu", "--no-progress", "--steps", "7"]
    results = groups(2).run(train_here, [*argv, "--data", "stream_data:streams", "--out", str(out)])
    assert [code for code, _ in results] == [0, 0], results
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["loss"]) == 7
    assert metrics["test_samples"] == sum(TEST_ROWS.values())  # rank 1 ran out of test batches first: no duplicates
    assert "uneven ends" in results[0][1]  # rank 0 said how the streams' lengths differed


def test_a_stream_factory_needs_a_strategy_with_a_process_per_device(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    argv = [
        "train",
        "--strategy",
        "replicated",
        "--devices",
        "2",
        "--accelerator",
        "cpu",
        "--data",
        "stream_data:streams",
    ]
    assert dpkit_main([*argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "dpkit train: error: --data: 'stream_data:streams' is a per-process stream factory (seed, rank, world_size), "
        "which goes with a strategy that runs a process per device (ddp, fsdp, zero, hsdp, localsgd, diloco); got "
        "strategy 'replicated'"
    ), err
