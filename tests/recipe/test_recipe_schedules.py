"""`dpkit train` for real runs: optimizers, schedules, clipping, evaluations, the best model, metrics streamed
to CSV and TensorBoard, a resume that continues a schedule bitwise, and changes on resume that are said,
recorded, and refused otherwise."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch
import torch.nn.functional as F

from dpkit.cli.main import main
from dpkit.examples import get_example
from dpkit.examples.digits import DigitsMLP
from dpkit.launch import StoppedBySignal
from dpkit.recipe import recipe
from dpkit.recipe.config import TrainConfig
from dpkit.recipe.metrics import LossLog
from dpkit.recipe.metrics_log import read_metrics_csv
from dpkit.recipe.optimization import lr_factor

REAL = ["--optimizer", "adamw", "--lr", "3e-3", "--schedule", "cosine", "--lr-warmup-steps", "3"]
REAL += ["--clip-grad-norm", "0.5", "--batch-size", "32", "--seed", "4"]


def train(tmp_path, name, *argv):
    return main(["train", "--accelerator", "cpu", "--no-progress", "-q", "--out", str(tmp_path / name), *argv])


def test_warm_up_is_linear_and_cosine_ends_at_zero():
    factor = lr_factor("cosine", steps=10, warmup_steps=4)
    assert [factor(k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(4) == 1.0 and factor(7) == pytest.approx(0.5) and factor(10) == pytest.approx(0.0, abs=1e-12)
    assert all(factor(k) > factor(k + 1) for k in range(4, 10))
    constant = lr_factor("constant", steps=10, warmup_steps=0)
    assert {constant(k) for k in range(10)} == {1.0}


def test_a_real_run_streams_its_metrics_and_keeps_the_best_model(tmp_path):
    assert (
        train(tmp_path, "r", *REAL, "--steps", "12", "--eval-every", "4", "--keep-best", "loss", "--tensorboard") == 0
    )
    out = tmp_path / "r"
    rows = read_metrics_csv(out / "metrics.csv")
    steps = [r for r in rows if r["loss"] is not None]
    evaluations = [r for r in rows if r["eval_loss"] is not None]
    assert [r["step"] for r in steps] == list(range(1, 13))
    factor = lr_factor("cosine", 12, 3)
    assert [r["lr"] for r in steps] == pytest.approx([3e-3 * factor(k) for k in range(12)], rel=1e-12)
    assert all(r["grad_norm"] > 0 for r in steps)
    assert [r["step"] for r in evaluations] == [4, 8, 12]
    metrics = json.loads((out / "metrics.json").read_text())
    assert [r["loss"] for r in steps] == pytest.approx(metrics["loss"], rel=1e-12)
    assert evaluations[-1]["eval_accuracy"] == metrics["test_accuracy"]

    # best.pt is the model of the evaluation with the lowest loss, and scores that loss again
    best = json.loads((out / "best.json").read_text())
    lowest = min(evaluations, key=lambda r: r["eval_loss"])
    assert best["metric"] == "loss" and best["step"] == lowest["step"] and best["value"] == lowest["eval_loss"]
    model = DigitsMLP()
    model.load_state_dict(torch.load(out / "best.pt", weights_only=True))
    _, _, x_test, y_test = get_example("digits").load_data(4)
    with torch.no_grad():
        loss = F.cross_entropy(model.eval()(x_test), y_test).item()
    assert loss == pytest.approx(best["value"], rel=1e-5)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 13))
    assert [e.step for e in events.Scalars("eval/accuracy")] == [4, 8, 12]


def _stop_at(monkeypatch, step):
    """SIGTERM to this process as the run takes `step` steps: the run stops there as a signal would stop it."""
    taken = []
    add_step = LossLog.add_step

    def add_and_maybe_stop(self, loss_sum, rows):
        add_step(self, loss_sum, rows)
        taken.append(1)
        if len(taken) == step:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(LossLog, "add_step", add_and_maybe_stop)


def config(tmp_path, name, **changes):
    values = dict(
        example="digits",
        strategy="replicated",
        accelerator="cpu",
        devices=2,
        steps=10,
        batch_size=32,
        seed=4,
        optimizer="adamw",
        lr=3e-3,
        schedule="cosine",
        lr_warmup_steps=3,
        clip_grad_norm=0.5,
        eval_every=4,
        log_every=3,
        checkpoint_every=100,
        progress=False,
        out=str(tmp_path / name),
    )
    return TrainConfig(**{**values, **changes})


def test_a_stopped_scheduled_run_resumes_bitwise(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        _stop_at(patch, 6)
        with pytest.raises(StoppedBySignal):
            recipe.run(config(tmp_path, "stopped"))
    recipe.run(config(tmp_path, "stopped", resume=True))
    recipe.run(config(tmp_path, "whole"))
    resumed, whole = (torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("stopped", "whole"))
    assert all(torch.equal(resumed[key], whole[key]) for key in whole)
    resumed_rows, whole_rows = (read_metrics_csv(tmp_path / name / "metrics.csv") for name in ("stopped", "whole"))
    assert resumed_rows == whole_rows  # no row lost or written twice across the stop
    assert len([r for r in whole_rows if r["loss"] is not None]) == 10


def test_a_resume_changes_what_it_says_records_it_and_refuses_the_rest(tmp_path, capsys):
    base = [*REAL, "--steps", "6", "--checkpoint-every", "3"]
    assert train(tmp_path, "r", *base) == 0
    capsys.readouterr()
    lower = [a if a != "3e-3" else "1e-3" for a in base]
    more = [a if a != "6" else "10" for a in lower]

    assert train(tmp_path, "r", *more, "--resume") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpkit train: error: --lr: the run in ") and "pass --change lr" in err, err
    assert train(tmp_path, "r", *more, "--resume", "--change", "lr") == 2  # a cosine's length moves its curve
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpkit train: error: --steps: the run in ") and "pass --change steps" in err, err
    optimizer = [a if a != "adamw" else "sgd" for a in more]
    assert train(tmp_path, "r", *optimizer, "--resume", "--change", "lr,steps,optimizer") == 2
    assert "--change: optimizer cannot change mid-run" in capsys.readouterr().err

    assert train(tmp_path, "r", *more, "--resume", "--change", "lr,steps") == 0
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run["lr"] == 1e-3 and run["steps"] == 10  # run.json says what the run is now
    assert {(c["setting"], c["from"], c["to"], c["step"]) for c in run["changes"]} == {
        ("lr", 3e-3, 1e-3, 6),
        ("steps", 6, 10, 6),
    }
    rows = [r for r in read_metrics_csv(tmp_path / "r" / "metrics.csv") if r["loss"] is not None]
    factor = lr_factor("cosine", 10, 3)
    assert [r["lr"] for r in rows[6:]] == pytest.approx([1e-3 * factor(k) for k in range(6, 10)], rel=1e-12)
    assert rows[5]["lr"] == pytest.approx(3e-3 * lr_factor("cosine", 6, 3)(5), rel=1e-12)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--optimizer", "lamb"], "--optimizer: invalid choice: 'lamb'"),
        (["--optimizer", "adamw", "--momentum", "0.9"], "--momentum: applies to --optimizer sgd"),
        (["--keep-best", "loss"], "--keep-best: the best model by loss needs evaluations; add --eval-every K"),
        (["--lr-warmup-steps", "200"], "--lr-warmup-steps: 200 is more than the run's 100 steps"),
        (["--clip-grad-norm", "0"], "--clip-grad-norm: expected a finite number > 0, got 0"),
        (["--change", "lr"], "--change: goes with --resume"),
    ],
)
def test_bad_settings_are_one_line(tmp_path, capsys, argv, message):
    assert train(tmp_path, "bad", *argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "bad").exists()


def test_momentum_is_sgds_and_the_optimizers_differ(tmp_path):
    finals = {}
    for optimizer in ("sgd", "adamw", "adam"):
        extra = ["--momentum", "0.9"] if optimizer == "sgd" else ["--weight-decay", "0.1"]
        assert train(tmp_path, optimizer, "--optimizer", optimizer, "--lr", "1e-2", "--steps", "5", *extra) == 0
        finals[optimizer] = json.loads((tmp_path / optimizer / "metrics.json").read_text())["loss"][-1]
    assert len({round(v, 6) for v in finals.values()}) == 3 and all(math.isfinite(v) for v in finals.values())
