"""`dpkit train`: outputs, a user model factory, and argument errors."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from closeness import difference_to_scale
from dpkit.cli.main import main
from dpkit.examples.digits import DigitsMLP

FACTORY = textwrap.dedent("""
    from torch import nn

    def tiny():
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
""")


def test_writes_a_clean_model_and_metrics(tmp_path):
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--strategy",
                "replicated",
                "--accelerator",
                "cpu",
                "--devices",
                "2",
                "--steps",
                "4",
                "--batch-size",
                "33",
                "--seed",
                "1",
                "--lr",
                "0.05",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    model = DigitsMLP()
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["strategy"] == "replicated" and metrics["devices"] == ["cpu:0", "cpu:1"]
    assert len(metrics["loss"]) == 4 and all(loss > 0 for loss in metrics["loss"])
    assert metrics["samples_per_second"] > 0 and metrics["batch_size"] == 33


def test_accumulate_counts_optimizer_steps(tmp_path):
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--strategy",
                "dp",
                "--accelerator",
                "cpu",
                "--devices",
                "2",
                "--steps",
                "3",
                "--accumulate",
                "2",
                "--batch-size",
                "16",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    assert len(json.loads((out / "metrics.json").read_text())["loss"]) == 3


def test_a_user_model_factory(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--model",
                "my_models:tiny",
                "--strategy",
                "dp",
                "--accelerator",
                "cpu",
                "--devices",
                "2",
                "--steps",
                "3",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    state = torch.load(out / "model.pt", weights_only=True)
    assert list(state) == ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--steps", "0"], "--steps: expected a positive int, got 0"),
        (["--batch-size", "0"], "--batch-size: expected a positive int, got 0"),
        (["--example", "imagenet"], "--example: unknown example 'imagenet'"),
        (["--model", "no_such_module:build"], "cannot import 'no_such_module'"),
        (["--strategy", "single", "--devices", "2"], "--devices 1"),
    ],
)
def test_errors_name_the_argument(tmp_path, capsys, argv, message):
    assert main(["train", "--accelerator", "cpu", "--out", str(tmp_path), "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


# --- checkpoints, signals and resume --------------------------------------------------------------------


def _train_process(out, *argv):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dpkit.cli.main",
            "train",
            "--accelerator",
            "cpu",
            "--no-progress",
            "--out",
            str(out),
            *argv,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_state(out, process, timeout_seconds=120):
    deadline = time.monotonic() + timeout_seconds
    while not (out / "state" / "latest").exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no state was saved"
        time.sleep(0.05)


def _dpkit_lines(stderr):
    """What the command said, without the log records (INFO dpkit: …)."""
    return [line for line in stderr.strip().splitlines() if not line.startswith(("INFO ", "DEBUG "))]


def test_a_signal_saves_the_state_and_resume_ends_with_the_uninterrupted_weights(tmp_path):
    # SIGTERM, a scheduler's preemption: SIGINT takes the same path to the saved state (recipe/stop.py); its own exit
    # code and line are the Ctrl-C tests' below and tests/recipe/test_recipe_faults.py's
    signum = signal.SIGTERM
    flags = ["--strategy", "replicated", "--devices", "2", "--batch-size", "32", "--momentum", "0.9", "--seed", "5"]
    steps = 400  # far more than the run gets to before the signal
    process = _train_process(tmp_path / "stopped", "--steps", str(steps), "--checkpoint-every", "4", *flags)
    _wait_for_state(tmp_path / "stopped", process)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signum
    lines = _dpkit_lines(stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    stopped_at = int(lines[0].split(" at step ")[1].split()[0])
    assert (
        lines[0].startswith("dpkit train: stopped by ")
        and f"state saved in {tmp_path / 'stopped' / 'state'}" in lines[0]
    )
    assert lines[0].endswith("--resume") and "resume with: dpkit train " in lines[0]

    # resume to a few steps past the stop, and an uninterrupted run of as many steps: the same, bitwise
    total = stopped_at + 3
    assert (
        main(
            [
                "train",
                "--accelerator",
                "cpu",
                "--no-progress",
                "--out",
                str(tmp_path / "stopped"),
                "--steps",
                str(total),
                "--checkpoint-every",
                "4",
                "--resume",
                *flags,
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "train",
                "--accelerator",
                "cpu",
                "--no-progress",
                "--out",
                str(tmp_path / "whole"),
                "--steps",
                str(total),
                *flags,
            ]
        )
        == 0
    )
    resumed, whole = (torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("stopped", "whole"))
    assert all(torch.equal(resumed[key], whole[key]) for key in whole)
    resumed_metrics, whole_metrics = (
        json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("stopped", "whole")
    )
    assert resumed_metrics["loss"] == whole_metrics["loss"] and len(whole_metrics["loss"]) == total
    assert resumed_metrics["resumed"] is True


def test_ctrl_c_without_checkpoints_is_one_line_and_130(tmp_path):
    process = _train_process(tmp_path / "run", "--steps", "100000", "--strategy", "dp", "--devices", "2")
    # the line comes once the run listens for signals: from then on a Ctrl-C stops it at a step boundary
    assert process.stdout.readline().startswith("dpkit train: digits with strategy dp")
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    lines = _dpkit_lines(stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert re.fullmatch(
        r"dpkit train: stopped by Ctrl-C \(SIGINT\) at step \d+ of 100000; nothing saved yet "
        r"\(--checkpoint-every K saves state to resume from\)",
        lines[0],
    ), lines[0]
    assert not (tmp_path / "run" / "model.pt").exists()


def test_ctrl_c_under_ddp_is_one_line_130_and_resumable(tmp_path):
    out = tmp_path / "run"
    process = _train_process(out, "--strategy", "ddp", "--devices", "2", "--steps", "100000", "--checkpoint-every", "3")
    _wait_for_state(out, process)
    process.send_signal(signal.SIGINT)  # the terminal's Ctrl-C reaches the launching process; it stops the workers
    _, stderr = process.communicate(timeout=90)
    assert process.returncode == 130
    lines = _dpkit_lines(stderr)
    assert len(lines) == 1 and "Traceback" not in stderr and "SignalException" not in stderr, stderr
    assert lines[0].startswith("dpkit train: stopped by Ctrl-C (SIGINT); state saved in ") and lines[0].endswith(
        "--resume"
    )
    # the state a ddp run saved continues under another strategy
    saved = json.loads((out / "run.json").read_text())
    assert saved["steps"] == 100000
    steps_saved = max(int(p.name.split("-")[1]) for p in (out / "state").glob("step-*"))
    assert (
        main(
            [
                "train",
                "--accelerator",
                "cpu",
                "--no-progress",
                "--out",
                str(out),
                "--strategy",
                "replicated",
                "--devices",
                "2",
                "--steps",
                str(steps_saved + 2),
                "--checkpoint-every",
                "3",
                "--resume",
            ]
        )
        == 0
    )
    assert len(json.loads((out / "metrics.json").read_text())["loss"]) == steps_saved + 2


def dpkit_here(argv: list[str]) -> int:
    """`dpkit ARGV` in this process (in a launched group's process: as its rank, as under `dpkit launch`)."""
    return main(argv)


def test_fsdp_trains_digits_like_one_device_and_resumes_bitwise(tmp_path, groups):
    """The issue's check: fsdp on 2 virtual CPU devices ends with single's weights, and 5 steps then --resume
    to 12 equal 12 in one go, bit for bit. The run in one go starts its own processes; the stopped and resumed
    runs run in a launched group, as under `dpkit launch`."""

    def train(name: str, *flags: str, group: bool = False) -> dict[str, torch.Tensor]:
        argv = ["train", "--accelerator", "cpu", "--batch-size", "63", "--lr", "0.2", "--momentum", "0.9"]
        argv += ["--out", str(tmp_path / name), "--no-progress", *flags]
        assert (groups(2).run(dpkit_here, argv) if group else [main(argv)]) == [0] * (2 if group else 1)
        return torch.load(tmp_path / name / "model.pt", weights_only=True)

    single = train("single", "--strategy", "single", "--steps", "12")
    fsdp = ["--strategy", "fsdp", "--devices", "2"]
    in_one_go = train("fsdp", *fsdp, "--steps", "12")
    train("resumed", *fsdp, "--steps", "5", "--checkpoint-every", "5", group=True)
    assert (tmp_path / "resumed" / "state" / "step-00000005" / "shards").is_dir()
    resumed = train("resumed", *fsdp, "--steps", "12", "--resume", group=True)
    assert difference_to_scale(in_one_go, single) <= 1e-5  # of the largest weight: fsdp sums in another order
    assert all(torch.equal(resumed[k], in_one_go[k]) for k in in_one_go)
    losses = json.loads((tmp_path / "fsdp" / "metrics.json").read_text())["loss"]
    assert losses[-1] < losses[0] - 0.01  # it trained: the equalities above are not of untouched weights
