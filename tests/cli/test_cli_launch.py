"""`dpkit launch` on the command line (the launcher itself is tested in tests/test_launch.py)."""

from __future__ import annotations

import socket

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
    assert main(["launch", "--nproc-per-node", "2", str(script)]) == 2
    assert "exited with code 4" in capsys.readouterr().err
