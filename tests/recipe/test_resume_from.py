"""Failures every process agrees on, and a next step that works (issue 43, items 4 and 5).

Under a strategy with a process per device, a state that only one process finds damaged (its own rank-R.pt) is
named once, by rank 0, in every process's error, before any process changes anything or goes on into training;
the message ends with the command that resumes from the state before it (`--resume-from STEP_DIR`), which works.
The runs go through `dpkit train`'s own code in the suite's shared launched group (as `dpkit launch -m dpkit
train` runs it), so no test starts processes of its own.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from recipe_runs import train_here

from dpkit.cli.main import main as dpkit_main
from dpkit.engine.placement import resolve_placement
from dpkit.launch.environment import ProcessPlace

DDP = ["--strategy", "ddp", "--devices", "2", "--accelerator", "cpu", "--no-progress", "--checkpoint-every", "2"]


def damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_file_only_rank_1_reads_is_named_once_with_a_command_that_works(tmp_path, groups):
    out = tmp_path / "run"
    first = groups(2).run(train_here, [*DDP, "--steps", "4", "--out", str(out)])
    assert [code for code, _ in first] == [0, 0], first
    damage(out / "state" / "step-00000004" / "rank-1.pt")
    weights_before = (out / "state" / "step-00000002" / "state.pt").read_bytes()

    codes_and_lines = groups(2).run(train_here, [*DDP, "--steps", "6", "--out", str(out), "--resume"])
    (code0, said0), (code1, said1) = codes_and_lines
    assert (code0, code1) == (2, 2), codes_and_lines
    errors0 = [line for line in said0.splitlines() if "error" in line]
    assert len(errors0) == 1 and "step-00000004/rank-1.pt" in errors0[0], said0
    assert "error" not in said1 and "Traceback" not in said1, said1  # rank 1 met it too, and left it to rank 0
    assert "training" not in said0 and "resuming at step" not in said0  # nobody went on
    # the line ends with the command that works: dpkit train … --resume-from <the state before it>
    command = errors0[0].split("resume from the state before it (step-00000002) with: ", 1)[1]
    words = shlex.split(command)
    assert words[:2] == ["dpkit", "train"] and words[-2:] == ["--resume-from", str(out / "state" / "step-00000002")]
    assert (out / "state" / "step-00000002" / "state.pt").read_bytes() == weights_before  # nothing changed

    resumed = groups(2).run(train_here, words[2:])
    assert [code for code, _ in resumed] == [0, 0], resumed
    assert "resuming at step 2 from " + str(out / "state" / "step-00000002") in resumed[0][1]
    assert (out / "state" / "step-00000006").is_dir()


def test_resume_from_names_a_step_directory_of_this_run(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--accelerator", "cpu", "--no-progress", "--steps", "2", "--checkpoint-every", "2"]
    assert dpkit_main([*argv, "--out", str(out)]) == 0
    capsys.readouterr()
    other = tmp_path / "elsewhere" / "step-00000002"
    other.mkdir(parents=True)
    assert dpkit_main([*argv, "--out", str(out), "--resume-from", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"dpkit train: error: --resume-from: {str(other)!r} is not a step directory of this run's state folder "
        f"{str(out / 'state')!r} (it holds step-00000002); pass one of its step-* directories, e.g. "
        f"{str(out / 'state' / 'step-00000002')!r}"
    )


def test_every_rank_refuses_a_device_list_that_does_not_match_the_launch_before_indexing_it():
    for rank in range(4):  # ranks 2 and 3 once died of an IndexError before the check was reached
        place = ProcessPlace(rank=rank, world_size=4, local_rank=rank, local_world_size=4)
        with pytest.raises(ValueError) as refused:
            resolve_placement("ddp", "cpu", 2, place=place)
        assert str(refused.value) == (
            "devices: 2 devices but the launcher started 4 processes on this node; pass devices=4 or launch with "
            "--nproc-per-node 2"
        )
