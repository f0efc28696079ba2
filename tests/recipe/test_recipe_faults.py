"""`dpkit train` loses nothing and mixes nothing up: restarts check what a first attempt checks, --overwrite
removes only after every check, a run stopped at its end can be finished, one run writes a folder at a time,
what is recorded is what ran, and stops (SIGHUP too) say what exists.

Signals are sent at a known point by the model itself (DPKIT_TEST_SIGNAL, see SIGNALS), or once the run
said it started: no test waits a fixed time."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from dpkit.cli.main import main

# the helpers the signal tests of `dpkit train` use (tests/cli/test_train.py)
_spec = importlib.util.spec_from_file_location("_train_cli_tests", Path(__file__).parents[1] / "cli" / "test_train.py")
_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cli)
_train_process, _wait_for_state, _dpkit_lines = _cli._train_process, _cli._wait_for_state, _cli._dpkit_lines

SIGNALS = textwrap.dedent('''
    import os, signal
    from torch import nn

    class Signals(nn.Sequential):
        """The digits MLP. DPKIT_TEST_SIGNAL=NAME@N: this process sends itself signal NAME in its Nth training
        forward; NAME@eval: in its first evaluation forward after training."""

        training_forwards = 0

        def forward(self, x):
            name, _, when = os.environ.get("DPKIT_TEST_SIGNAL", "").partition("@")
            if self.training:
                Signals.training_forwards += 1
                if name and when == str(Signals.training_forwards):
                    os.kill(os.getpid(), getattr(signal, name))
            elif name and when == "eval" and Signals.training_forwards:
                os.kill(os.getpid(), getattr(signal, name))
            return super().forward(x)

    def build():
        Signals.training_forwards = 0
        return Signals(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
''')

# data every process can read, except rank 1 of launched workers: a check only the workers make
PICKY_DATA = textwrap.dedent("""
    import os
    import torch

    def load(seed):
        if os.environ.get("RANK") == "1":
            raise OSError("rank 1 cannot read its shard")
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(96, 64, generator=generator)
        y = torch.randint(0, 10, (96,), generator=generator)
        return x[:64], y[:64], x[64:], y[64:]
""")

# a worker group whose first attempt fails for a reason a restart may cure (rank 1 is SIGKILLed; rank 0 waits
# to be stopped with it); the restarted group runs `dpkit train`
RESTARTED_ONCE = textwrap.dedent("""
    import os, signal, sys
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        signal.pause()
    from dpkit.cli.main import main
    from dpkit.launch.worker import exit_worker
    exit_worker(main(sys.argv[1:]))
""")

CPU = ["--accelerator", "cpu", "--no-progress"]


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """signals:build and picky:load importable here and in the processes the test starts."""
    (tmp_path / "signals.py").write_text(SIGNALS)
    (tmp_path / "picky.py").write_text(PICKY_DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("DPKIT_TEST_SIGNAL", raising=False)
    return tmp_path


def snapshot(folder):
    """Every file under `folder` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def train(out, *argv):
    return main(["train", *CPU, "--out", str(out), *argv])


def errors(capsys):
    return [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("INFO ")]


def _signalled_run(capfd, out, how, *argv):
    """`dpkit train` in this process, which sends itself a signal (`how`, DPKIT_TEST_SIGNAL) from the model: its
    exit code (what main returns, the command's exit code), lines. The run's handlers take the signal; without them
    a Ctrl-C still ends in main (130), and SIGTERM or SIGHUP would end the test's process: a failure either way."""
    env_before = os.environ.get("DPKIT_TEST_SIGNAL")
    os.environ["DPKIT_TEST_SIGNAL"] = how
    try:
        capfd.readouterr()
        code = main(["train", *CPU, "--out", str(out), "--model", "signals:build", *argv])
    finally:
        if env_before is None:
            del os.environ["DPKIT_TEST_SIGNAL"]
        else:
            os.environ["DPKIT_TEST_SIGNAL"] = env_before
    stdout, stderr = capfd.readouterr()
    lines = _dpkit_lines(stderr)
    assert "Traceback" not in stderr, stderr
    return code, lines, stdout


# --- 1. a restarted worker checks what the first attempt checked ------------------------------------------


def _as_launched_worker(monkeypatch, job, attempt):
    """This process as rank 0 of 1 under a launcher, in attempt `attempt` of job `job`."""
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29599",
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "DPKIT_TRAIN_JOB": job,
    }.items():
        monkeypatch.setenv(name, value)


def test_a_restarted_worker_refuses_a_run_its_job_did_not_create_and_continues_its_own(
    tmp_path, modules, monkeypatch, capsys
):
    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    assert train(theirs, "--steps", "2", "--checkpoint-every", "1") == 0
    before = snapshot(theirs)
    capsys.readouterr()
    # a restarted group of another job, with another lr: refused as its first attempt was, nothing touched
    _as_launched_worker(monkeypatch, "job-b", attempt=1)
    assert train(theirs, "--steps", "4", "--lr", "0.5", "--checkpoint-every", "1") == 2
    lines = errors(capsys)
    assert len(lines) == 1 and f"--out: {str(theirs)!r} already holds a run" in lines[0], lines
    assert snapshot(theirs) == before

    # job C's first attempt stops at step 2 (whatever stopped it); its restart continues the run C created
    flags = ["--model", "signals:build", "--steps", "5", "--checkpoint-every", "2", "--batch-size", "16"]
    _as_launched_worker(monkeypatch, "job-c", attempt=0)
    monkeypatch.setenv("DPKIT_TEST_SIGNAL", "SIGTERM@2")
    assert train(mine, *flags) == 128 + signal.SIGTERM
    assert json.loads((mine / "run.json").read_text())["job"] == "job-c"
    monkeypatch.delenv("DPKIT_TEST_SIGNAL")
    half = snapshot(mine)
    _as_launched_worker(monkeypatch, "job-d", attempt=1)  # not C's: refused
    assert train(mine, *flags) == 2 and snapshot(mine) == half
    _as_launched_worker(monkeypatch, "job-c", attempt=1)
    capsys.readouterr()
    assert train(mine, *flags) == 0
    assert "resuming at step 2" in capsys.readouterr().out
    metrics = json.loads((mine / "metrics.json").read_text())
    assert metrics["resumed"] is True and len(metrics["loss"]) == 5


def test_a_restart_under_the_launcher_never_resumes_another_run(tmp_path, modules, capfd):
    out = tmp_path / "run"
    assert train(out, "--steps", "2", "--checkpoint-every", "1") == 0
    before = snapshot(out)
    (tmp_path / "restarted_once.py").write_text(RESTARTED_ONCE)
    capfd.readouterr()
    # `dpkit launch` in this process (main): the workers are the processes that matter
    code = main(
        ["launch", "--nproc-per-node", "2", "--max-restarts", "1"]
        + [str(tmp_path / "restarted_once.py"), "train", "--strategy", "ddp", "--devices", "2", *CPU]
        + ["--steps", "4", "--lr", "0.5", "--checkpoint-every", "1", "--out", str(out)]
    )
    stderr = capfd.readouterr().err
    # the restarted group (the first one only died) refused the folder as a first attempt does
    assert code == 2, stderr[-3000:]
    assert f"dpkit train: error: --out: {str(out)!r} already holds a run" in stderr, stderr[-3000:]
    assert snapshot(out) == before


# --- 2. --overwrite removes the old run only after every check passed --------------------------------------


def test_overwrite_keeps_the_old_run_when_a_worker_refuses(tmp_path, modules, capfd):
    out = tmp_path / "run"
    assert train(out, "--data", "picky:load", "--steps", "2", "--batch-size", "16") == 0
    before = snapshot(out)
    capfd.readouterr()
    # `dpkit train` in this process, which starts the workers
    code = train(out, "--strategy", "ddp", "--devices", "2", "--data", "picky:load", "--steps", "2", "--overwrite")
    stderr = capfd.readouterr().err
    # rank 0 never removed anything: it never heard that every process was ready
    assert snapshot(out) == before
    assert code == 2, stderr[-3000:]
    # rank 1 said why, once; the launching process added nothing
    assert _dpkit_lines(stderr) == [
        "dpkit train: error: --data: picky:load(seed) raised OSError: rank 1 cannot read its shard"
    ], stderr[-3000:]


def test_a_precision_the_devices_cannot_do_keeps_the_old_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "2") == 0
    before = snapshot(out)
    capsys.readouterr()
    code = train(out, "--strategy", "ddp", "--devices", "2", "--precision", "16-mixed", "--overwrite")
    lines = errors(capsys)
    assert code == 2 and len(lines) == 1 and "--precision 16-mixed needs CUDA" in lines[0], lines
    assert snapshot(out) == before


# --- 3. a run stopped at its end can be finished; a finished run is finished ------------------------------


@pytest.mark.parametrize("when,during", [("4", ""), ("eval", ", in the final evaluation")])
def test_a_run_stopped_at_its_end_is_completed_by_the_resume_command_it_printed(tmp_path, modules, capfd, when, during):
    out = tmp_path / "stopped"
    flags = ["--steps", "4", "--checkpoint-every", "2", "--batch-size", "32", "--momentum", "0.9"]
    code, lines, _ = _signalled_run(capfd, out, f"SIGTERM@{when}", *flags)
    assert code == 128 + signal.SIGTERM and len(lines) == 1, lines
    assert lines[0].startswith(
        f"dpkit train: stopped by SIGTERM at step 4 of 4{during}; state saved in {out / 'state' / 'step-00000004'}; "
        "resume with: dpkit train "
    ), lines[0]
    assert not (out / "model.pt").exists() and not (out / "metrics.json").exists()

    # the printed command completes the run: evaluation, model.pt, metrics.json; the model of a run never stopped
    assert main(shlex.split(lines[0].split("resume with: dpkit ", 1)[1])) == 0
    assert train(tmp_path / "whole", "--model", "signals:build", *flags) == 0
    completed, whole = (torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("stopped", "whole"))
    assert all(torch.equal(completed[key], whole[key]) for key in whole)
    completed_metrics, whole_metrics = (
        json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("stopped", "whole")
    )
    assert completed_metrics["loss"] == whole_metrics["loss"] and len(whole_metrics["loss"]) == 4
    assert completed_metrics["test_accuracy"] == whole_metrics["test_accuracy"]


def test_resume_of_a_finished_run_exits_0_with_one_line_and_touches_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "2", "--checkpoint-every", "1") == 0
    before = snapshot(out)
    capsys.readouterr()
    assert train(out, "--steps", "2", "--checkpoint-every", "1", "--resume") == 0
    captured = capsys.readouterr()
    said = [line for line in captured.out.splitlines() + captured.err.splitlines() if not line.startswith("INFO ")]
    assert said == [
        f"dpkit train: the run in {out} is already finished (2 steps; {out / 'model.pt'} and "
        f"{out / 'metrics.json'} are written); nothing to do"
    ]
    assert snapshot(out) == before
    # fewer steps than the run took is another run: refused, naming --steps
    assert train(out, "--steps", "1", "--resume") == 2
    assert errors(capsys) == [
        f"dpkit train: error: --steps: the run in {str(out)!r} has already taken 2 steps; give 2 to finish it "
        "or more to continue it"
    ]
    assert snapshot(out) == before


# --- 4. one writer per run folder ------------------------------------------------------------------------


def test_a_second_run_on_a_folder_in_use_is_refused_and_a_dead_holder_frees_it(tmp_path, capsys):
    out = tmp_path / "run"
    first = _train_process(out, "--steps", "100000")
    try:
        assert first.stdout.readline().startswith("dpkit train: digits with strategy single")
        assert train(out, "--steps", "2", "--overwrite") == 2
        lines = errors(capsys)
        assert len(lines) == 1 and lines[0].startswith(
            f"dpkit train: error: --out: {str(out)!r} is in use by another run (pid {first.pid} on "
        ), lines
        assert "one run writes a folder at a time" in lines[0]
    finally:
        first.kill()  # SIGKILL: no handler runs, the lock file stays; the kernel releases the lock
        first.communicate(timeout=60)
    assert (out / ".dpkit-train.lock").exists()
    assert train(out, "--steps", "2", "--overwrite") == 0
    assert len(json.loads((out / "metrics.json").read_text())["loss"]) == 2
    assert not (out / ".dpkit-train.lock").exists()  # released with the run


def test_a_refused_run_leaves_no_folder_behind(tmp_path, capsys):
    out = tmp_path / "new" / "run"
    assert train(out, "--resume") == 2
    assert "--resume: no saved state" in errors(capsys)[0]
    assert not (tmp_path / "new").exists()


# --- 5. what is recorded is what ran -----------------------------------------------------------------------


def test_without_run_json_the_settings_are_checked_against_the_state(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "2", "--checkpoint-every", "2", "--lr", "0.1", "--seed", "1") == 0
    (out / "run.json").unlink()
    before = snapshot(out)
    capsys.readouterr()
    state = out / "state" / "step-00000002"
    for flag, value, saved in (("--lr", "0.5", "0.1"), ("--seed", "3", "1")):
        others = {"--lr": "0.1", "--seed": "1"}
        others[flag] = value
        argv = [arg for pair in others.items() for arg in pair]
        assert train(out, "--steps", "4", "--resume", *argv) == 2
        advice = "to change it from step 2 on, pass --change lr (recorded in run.json), or " if flag == "--lr" else ""
        assert errors(capsys) == [
            f"dpkit train: error: {flag}: the run in {str(out)!r} was trained with {saved} (its state "
            f"{str(state)!r} says so), got {value}; {advice}resume with the same value"
        ]
        assert snapshot(out) == before
    # the same settings resume, and run.json is written again with them
    assert train(out, "--steps", "4", "--resume", "--lr", "0.1", "--seed", "1") == 0
    assert json.loads((out / "run.json").read_text())["lr"] == 0.1


def test_a_damaged_run_json_is_named(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "2", "--checkpoint-every", "2") == 0
    (out / "run.json").write_text('{"seed": 0, "lr"')  # truncated
    capsys.readouterr()
    assert train(out, "--steps", "4", "--resume") == 2
    lines = errors(capsys)
    assert len(lines) == 1 and lines[0].startswith(
        f"dpkit train: error: --out: {str(out / 'run.json')!r} is damaged ("
    ), lines
    assert "delete it and the settings are checked against the saved state" in lines[0]


def test_every_json_the_recipe_writes_is_written_whole(tmp_path, monkeypatch):
    import dpkit.recipe.folder as run_folder

    written = []
    real = run_folder.atomic_write

    def spy(path, write):
        written.append(Path(path).name)
        return real(path, write)

    monkeypatch.setattr(run_folder, "atomic_write", spy)
    assert train(tmp_path / "run", "--steps", "2", "--checkpoint-every", "1") == 0
    assert {"run.json", "metrics.json"} <= set(written)


# --- 6. the lesser ones -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _read_only(folder):
    """`folder` unwritable, also for root (immutable attribute); skips where that cannot be done."""
    if os.geteuid() != 0:
        folder.chmod(0o500)
        try:
            yield
        finally:
            folder.chmod(0o700)
        return
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("root, and this filesystem has no immutable attribute (chattr +i) to make a folder read-only")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_read_only_state_folder_is_refused_before_training(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "2", "--checkpoint-every", "1") == 0
    capsys.readouterr()
    with _read_only(out / "state"):
        code = train(out, "--steps", "4", "--checkpoint-every", "1", "--resume")
        captured = capsys.readouterr()
    assert code == 2 and "dpkit train: digits with" not in captured.out  # never started training
    lines = [line for line in captured.err.splitlines() if not line.startswith("INFO ")]
    assert len(lines) == 1 and lines[0].startswith(
        f"dpkit train: error: --out: {str(out / 'state')!r} is not writable ("
    ), lines


def test_ctrl_c_after_a_resume_without_checkpoints_names_the_state_that_exists(tmp_path, modules, capfd):
    out = tmp_path / "run"
    assert train(out, "--model", "signals:build", "--steps", "2", "--checkpoint-every", "2") == 0
    code, lines, _ = _signalled_run(capfd, out, "SIGINT@2", "--steps", "50", "--resume")
    assert code == 130 and len(lines) == 1, lines
    assert lines[0].startswith(
        "dpkit train: stopped by Ctrl-C (SIGINT) at step 4 of 50; this run saved no state (--checkpoint-every K "
        f"saves state to resume from); the newest state is {out / 'state' / 'step-00000002'} (step 2); resume "
        "from it with: dpkit train "
    ), lines[0]
    assert lines[0].endswith("--resume")


def test_sighup_saves_the_state_and_exits_129(tmp_path, modules, capfd):
    out = tmp_path / "run"
    code, lines, _ = _signalled_run(capfd, out, "SIGHUP@3", "--steps", "50", "--checkpoint-every", "100")
    assert code == 128 + signal.SIGHUP and len(lines) == 1, lines
    assert lines[0].startswith(
        f"dpkit train: stopped by SIGHUP at step 3 of 50; state saved in {out / 'state' / 'step-00000003'}; "
    ), lines[0]
