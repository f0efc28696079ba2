"""`dpkit launch` on the command line (the launcher itself is tested in tests/test_launch.py)."""

from __future__ import annotations

import os
import socket

import pytest

from dpkit.cli.main import main


def test_runs_the_script_once_per_process_with_its_arguments(tmp_path):
    script = tmp_path / "touch.py"
    script.write_text(
        "import os, sys\nopen(os.path.join(sys.argv[1], 'rank' + os.environ['RANK'] + sys.argv[2]), 'w').close()\n"
    )
    assert main(["launch", "--nproc-per-node", "2", str(script), str(tmp_path), "-x"]) == 0
    assert sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0-x", "rank1-x"]


def test_a_taken_port_is_reported_as_an_error(tmp_path, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        assert main(["launch", "--master-port", str(port), str(tmp_path / "x.py")]) == 2
    assert f"dpkit launch: error: --master-port: port {port} on 127.0.0.1 is already in use" in capsys.readouterr().err


def test_a_failing_worker_is_reported(tmp_path, capsys):
    script = tmp_path / "fails.py"
    script.write_text("raise SystemExit(4)\n")
    # a failure, not bad input (2): a requeue script may try again (issue 43)
    assert main(["launch", "--nproc-per-node", "2", str(script)]) == 1
    assert "exited with code 4" in capsys.readouterr().err


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if not line.startswith("INFO ")]


def test_a_missing_script_or_module_is_one_line_before_any_worker_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--nproc-per-node", "2", "missing.py", "--lr", "1"]) == 2
    assert _error_lines(capsys) == [
        "dpkit launch: error: script: no such file 'missing.py'; expected a Python file to run "
        "(or, with --module, a module name)"
    ]
    assert main(["launch", "--nproc-per-node", "2", "-m", "mypackage.train"]) == 2
    assert _error_lines(capsys) == [
        "dpkit launch: error: script: no module named 'mypackage'; with --module the script is a module to run as "
        "`python -m`, importable from here (installed, or a package in the current folder)"
    ]


@pytest.mark.parametrize(
    "argv,line",
    [
        (
            ["--nproc-per-node", "many"],
            "dpkit launch: error: --nproc-per-node: expected a positive count of processes or auto, got 'many'",
        ),
        (["--show-ranks", "0,x"], "dpkit launch: error: --show-ranks: expected ranks such as 0 or 0,4, got '0,x'"),
        (
            ["--nproc-per-node", "2", "--show-ranks", "2"],
            "dpkit launch: error: --show-ranks: 2 is not a rank of this launch; its ranks are 0 … 1",
        ),
    ],
)
def test_bad_output_and_process_flags_are_one_line(tmp_path, capsys, argv, line):
    assert main(["launch", *argv, str(tmp_path / "train.py")]) == 2
    lines = _error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith(line), lines


def test_inside_slurm_a_contradicting_flag_is_one_line_and_no_slurm_ignores_slurm(tmp_path, capsys, monkeypatch):
    for name in [name for name in os.environ if name.startswith("SLURM")]:
        monkeypatch.delenv(name)
    env = {"SLURM_JOB_ID": "31", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2"}
    for name, value in {**env, "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "1"}.items():
        monkeypatch.setenv(name, value)
    script = tmp_path / "never.py"
    assert main(["launch", "--node-rank", "0", str(script)]) == 2
    assert _error_lines(capsys) == [
        "dpkit launch: error: --node-rank: 0, but SLURM numbers this node 1 (SLURM_NODEID=1); "
        "inside an srun step the node rank comes from SLURM"
    ]
    # --no-slurm: one node, as outside SLURM (here the missing script is the next thing to say)
    assert main(["launch", "--no-slurm", "--node-rank", "0", str(script)]) == 2
    assert _error_lines(capsys) == [
        f"dpkit launch: error: script: no such file {str(script)!r}; expected a Python file to run "
        "(or, with --module, a module name)"
    ]


def test_help_shows_examples_and_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["launch", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "\nexamples:\n  dpkit launch --nproc-per-node auto train.py" in text
    assert "  srun --ntasks-per-node=1 dpkit launch --nproc-per-node auto train.py" in text
    assert "(default: 1)" in text and "(default: no files)" in text


def test_log_dir_show_ranks_and_no_prefix_reach_the_launcher(tmp_path, capsys):
    script = tmp_path / "says.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'])\n")
    logs = tmp_path / "logs"
    argv = ["launch", "--nproc-per-node", "2", "--log-dir", str(logs), "--show-ranks", "1", "--no-rank-prefix"]
    assert main([*argv, str(script)]) == 0
    assert capsys.readouterr().out == "hello from 1\n"
    assert sorted(path.read_text() for path in logs.glob("dpkit_*/attempt_0/*/stdout.log")) == [
        "hello from 0\n",
        "hello from 1\n",
    ]
