"""A stop with a background save in flight (issue 48): Ctrl-C (or SIGTERM) lets the save finish, saves the step it
stopped at and says so; a second Ctrl-C gives the save up before its commit and names the newest whole state; either
way the printed command resumes to the uninterrupted run's weights.

The save is held inside its write by the model's module (HELD below) until the model has sent its signals, so the
save is in flight when the stop arrives: driven from the run, not raced against a sleep."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap

import pytest
import torch

from dpkit.cli.main import main

HELD = textwrap.dedent('''
    import os, signal, threading
    from torch import nn
    import dpkit.checkpoint.writes as writes

    released = threading.Event()
    hold_step = os.environ.get("DPKIT_TEST_HOLD_STEP")  # the step whose background write is held
    real_write = writes.write_checked

    def held_write(content, handle):
        if hold_step and f"step-{int(hold_step):08d}" in str(handle.name):
            released.wait()  # until the model has sent its signals (forever for a second Ctrl-C)
        real_write(content, handle)

    writes.write_checked = held_write

    class Signalling(nn.Sequential):
        """The digits MLP; DPKIT_TEST_SIGINTS=N@F: N SIGINTs in its Fth training forward, then the held write goes
        on (after one; after two the process is already stopping)."""

        forwards = 0

        def forward(self, x):
            count, _, at = os.environ.get("DPKIT_TEST_SIGINTS", "").partition("@")
            if self.training:
                Signalling.forwards += 1
                if count and at == str(Signalling.forwards):
                    for _ in range(int(count)):
                        os.kill(os.getpid(), signal.SIGINT)
                    released.set()
            return super().forward(x)

    def build():
        Signalling.forwards = 0
        return Signalling(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
''')

FLAGS = ["--model", "held:build", "--steps", "4", "--batch-size", "32", "--momentum", "0.9", "--seed", "3"]


@pytest.fixture
def held_module(tmp_path, monkeypatch):
    (tmp_path / "held.py").write_text(HELD)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def stopped_run(tmp_path, out, hold_step: int, sigints: str, *argv: str) -> tuple[int, list[str]]:
    """`dpkit train` in its own process, the write of `hold_step` held and SIGINTs sent as `sigints` says."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "DPKIT_TEST_HOLD_STEP": str(hold_step),
        "DPKIT_TEST_SIGINTS": sigints,
    }
    command = [sys.executable, "-m", "dpkit", "train", "--accelerator", "cpu", "--no-progress", "--out", str(out)]
    process = subprocess.run([*command, *FLAGS, *argv], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in process.stderr.splitlines() if line.startswith("dpkit train:")]
    assert "Traceback" not in process.stderr, process.stderr
    return process.returncode, lines


def resumed_equals_uninterrupted(tmp_path, line: str) -> None:
    """The command the stop line printed finishes the run with the weights of a run never stopped."""
    assert main(shlex.split(line.split("with: dpkit ", 1)[1])) == 0
    assert main(["train", "--accelerator", "cpu", "--no-progress", "--out", str(tmp_path / "whole"), *FLAGS]) == 0
    resumed, whole = (torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("run", "whole"))
    assert all(torch.equal(resumed[key], whole[key]) for key in whole)


def test_ctrl_c_with_a_save_in_flight_lets_it_finish_and_saves_the_step_it_stopped_at(tmp_path, held_module):
    out = tmp_path / "run"
    # step 2's save is held in its write until step 3's forward has sent the Ctrl-C
    code, lines = stopped_run(tmp_path, out, 2, "1@3", "--checkpoint-every", "2")
    assert code == 130 and len(lines) == 1, lines
    assert lines[0].startswith(
        f"dpkit train: stopped by Ctrl-C (SIGINT) at step 3 of 4; state saved in {out / 'state' / 'step-00000003'}; "
        "resume with: dpkit train "
    ), lines[0]
    state = out / "state"
    assert sorted(path.name for path in state.iterdir()) == ["latest", "step-00000002", "step-00000003"]
    assert (state / "latest").read_text().split()[0] == "step-00000003"
    resumed_equals_uninterrupted(tmp_path, lines[0])


def test_a_second_ctrl_c_gives_the_save_in_flight_up_and_names_the_newest_whole_state(tmp_path, held_module):
    out = tmp_path / "run"
    # step 2's save is held for good; two Ctrl-C in step 3's forward: stop now
    code, lines = stopped_run(tmp_path, out, 2, "2@3", "--checkpoint-every", "1")
    assert code == 130 and len(lines) == 1, lines
    newest = out / "state" / "step-00000001"
    assert lines[0].startswith(
        "dpkit train: stopped by Ctrl-C (SIGINT) at step 2 of 4, the background save of step 2 given up; "
        f"the newest state is {newest} (step 1); resume from it with: dpkit train "
    ), lines[0]
    state = out / "state"
    assert (state / "latest").read_text().split()[0] == "step-00000001"
    assert not (state / "step-00000002").exists()  # (its temporary folder the next save removes)
    resumed_equals_uninterrupted(tmp_path, lines[0])
