"""The launcher on torch.distributed.run: ports, validation, environment, failures and restarts."""

from __future__ import annotations

import json
import os
import socket
import textwrap

import pytest

from dpkit.launch import LaunchError, free_port, launch, loopback_interface, port_in_use

ENV_SCRIPT = textwrap.dedent("""
    import json, os, sys
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
            "GLOO_SOCKET_IFNAME"]
    out = sys.argv[1]
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as handle:
        json.dump({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[2:]}, handle)
""")


def listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def test_free_port_is_free_and_a_listening_port_is_in_use():
    port = free_port("127.0.0.1")
    assert 0 < port < 65536 and not port_in_use("127.0.0.1", port)
    with listening_socket() as sock:
        assert port_in_use("127.0.0.1", sock.getsockname()[1])


def test_a_taken_port_is_a_clear_error_before_anything_starts(tmp_path):
    with listening_socket() as sock:
        port = sock.getsockname()[1]
        with pytest.raises(ValueError, match=f"--master-port: port {port} on 127.0.0.1 is already in use"):
            launch(str(tmp_path / "never_run.py"), nproc_per_node=2, master_port=port)


@pytest.mark.parametrize("kwargs,match", [
    ({"nproc_per_node": 0}, "--nproc-per-node"),
    ({"nnodes": 2, "node_rank": 2, "master_addr": "127.0.0.1", "master_port": 29555}, "--node-rank"),
    ({"nnodes": 2, "node_rank": 1}, "--master-addr/--master-port: required with --nnodes > 1"),
    ({"max_restarts": -1}, "--max-restarts"),
    ({"master_port": 70000}, "not a TCP port"),
])
def test_invalid_arguments_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch("script.py", **kwargs)


def test_workers_get_ranks_the_rendezvous_and_their_arguments(tmp_path):
    script = tmp_path / "env.py"
    script.write_text(ENV_SCRIPT)
    before = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")}
    launch(str(script), [str(tmp_path), "--flag", "value"], nproc_per_node=2)
    assert {name: os.environ.get(name) for name in before} == before  # the launcher leaves this process as it was
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(seen):
        env = record["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["OMP_NUM_THREADS"] is not None
        if before["GLOO_SOCKET_IFNAME"] is None and loopback_interface():
            assert env["GLOO_SOCKET_IFNAME"] == loopback_interface()  # gloo stays on loopback too
        assert record["argv"] == ["--flag", "value"]
    assert seen[0]["env"]["MASTER_PORT"] == seen[1]["env"]["MASTER_PORT"]


def test_a_failed_worker_is_named_with_its_exit_code(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    with pytest.raises(LaunchError, match=r"worker rank 1 \(local rank 1, pid \d+\) exited with code 3"):
        launch(str(script), nproc_per_node=2)


def test_max_restarts_restarts_the_group_after_a_failure(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        marker = {str(tmp_path / 'failed-once')!r}
        if os.environ["RANK"] == "0" and not os.path.exists(marker):
            open(marker, "w").close()
            sys.exit(5)
        open({str(tmp_path)!r} + f"/done-{{os.environ['RANK']}}-{{os.environ['TORCHELASTIC_RESTART_COUNT']}}", "w").close()
    """))
    launch(str(script), nproc_per_node=2, max_restarts=1)
    assert (tmp_path / "done-0-1").exists() and (tmp_path / "done-1-1").exists()
    with pytest.raises(LaunchError):
        (tmp_path / "failed-once").unlink()
        launch(str(script), nproc_per_node=2, max_restarts=0)
