"""What a resumed `dpkit train` run records belongs to the history it continues: best.pt / best.json rolled back
to the saved state's, TensorBoard with every step once; a nan evaluation is divergence and writes nothing.

A run killed after its last saved state is made from a finished run: its newer states, model.pt and
metrics.json removed and `latest` pointed back, as SIGKILL would have left the folder (in-process, no waits)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dpkit.checkpoint.steps import LATEST, pointer_text, step_directory_name
from dpkit.cli.main import main
from dpkit.recipe.metrics_log import read_metrics_csv

CPU = ["--accelerator", "cpu", "--no-progress"]
SMALL = ["--batch-size", "32", "--log-every", "1", "--eval-every", "1"]


def train(out, *argv):
    return main(["train", *CPU, "--out", str(out), *SMALL, *argv])


def killed_after(out, step):
    """The folder as a run killed after its state of `step` (and the files of later steps) would leave it."""
    states = out / "state"
    for folder in states.glob("step-*"):
        if int(folder.name.removeprefix("step-")) > step:
            shutil.rmtree(folder)
    (states / LATEST).write_text(pointer_text(step_directory_name(step)))
    (out / "model.pt").unlink()
    (out / "metrics.json").unlink()


def best_in_csv(out, metric="eval_loss"):
    rows = [row for row in read_metrics_csv(out / "metrics.csv") if row[metric] is not None]
    row = min(rows, key=lambda row: row[metric])
    return int(row["step"]), row[metric]


def test_a_resume_rolls_best_back_to_the_saved_states_history(tmp_path):
    out = tmp_path / "run"
    flags = ["--steps", "3", "--checkpoint-every", "2", "--keep", "5", "--keep-best", "loss"]
    assert train(out, *flags) == 0
    assert json.loads((out / "best.json").read_text())["step"] == 3  # the loss falls every step here
    killed_after(out, 2)  # best.pt and best.json on disk are step 3's, a step the resumed run takes again

    # completed at step 2: its final evaluation equals step 2's, no better, so the best is step 2's model
    assert train(out, *flags[2:], "--steps", "2", "--resume") == 0
    best, metrics = json.loads((out / "best.json").read_text()), json.loads((out / "metrics.json").read_text())
    assert best["step"] == 2 and metrics["best"] == {k: best[k] for k in ("metric", "step", "value")}
    assert (best["step"], best["loss"]) == best_in_csv(out)
    model, best_model = (torch.load(out / name, weights_only=True) for name in ("model.pt", "best.pt"))
    assert all(torch.equal(model[key], best_model[key]) for key in model)


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [event.step for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.parametrize("killed_at,resumed_to", [(2, 4), (4, 4)])
def test_tensorboard_keeps_every_step_once_across_a_resume(tmp_path, killed_at, resumed_to):
    out = tmp_path / "run"
    flags = ["--checkpoint-every", "2", "--keep", "5", "--eval-every", "2", "--tensorboard"]
    assert train(out, "--steps", "4", *flags) == 0
    killed_after(out, killed_at)
    assert train(out, "--steps", str(resumed_to), *flags, "--resume") == 0
    scalars = _scalars(out / "tensorboard")
    assert scalars["train/loss"] == [1, 2, 3, 4]
    assert scalars["eval/loss"] == scalars["eval/accuracy"] == [2, 4]
    rows = read_metrics_csv(out / "metrics.csv")
    assert [int(row["step"]) for row in rows if row["loss"] is not None] == [1, 2, 3, 4]
    assert [int(row["step"]) for row in rows if row["eval_loss"] is not None] == [2, 4]


NAN_IN_EVALUATION = '''
import torch
from torch import nn


class NanInEvaluation(nn.Sequential):
    """Trains as the digits MLP does; its evaluation gives nan scores (a broken running statistic would)."""

    def forward(self, x):
        out = super().forward(x)
        return out if self.training else out * float("nan")


def build():
    return NanInEvaluation(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
'''


@pytest.mark.parametrize("keep_best", ["accuracy", "loss"])
def test_a_nan_evaluation_is_divergence_and_writes_nothing_from_it(tmp_path, monkeypatch, capsys, keep_best):
    (tmp_path / "nan_in_evaluation.py").write_text(NAN_IN_EVALUATION)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    code = train(out, "--model", "nan_in_evaluation:build", "--steps", "2", "--keep-best", keep_best)
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("INFO ")]
    assert code == 3, lines
    # the words of a nan training loss (tests/cli/test_train.py), for the evaluation
    assert len(lines) == 1 and lines[0].startswith("dpkit train: error: --lr: the evaluation loss became nan ("), lines
    assert lines[0].endswith(
        ") at step 1 with --lr 0.1; training stopped and wrote nothing from it; try a smaller lr or --clip-grad-norm 1"
    ), lines
    assert sorted(path.name for path in out.iterdir()) == ["metrics.csv"]
    rows = read_metrics_csv(out / "metrics.csv")
    assert [row["step"] for row in rows] == [1.0] and rows[0]["eval_loss"] is None
