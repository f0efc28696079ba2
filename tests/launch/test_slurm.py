"""Inside a SLURM job `dpkit launch` takes the nodes, this node's rank and the rendezvous from SLURM's variables;
two launchers with a simulated 2-node srun step meet over loopback."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from dpkit.launch import launch, port_in_use
from dpkit.launch.agent import processes_per_node
from dpkit.launch.slurm import SLURM_PORT_BASE, SLURM_PORT_SPAN, expand_nodes, from_slurm, slurm_port


def step(nodes: str, node_id: int, count: int, tasks: int | None = None, job: str = "4242") -> dict[str, str]:
    """What srun sets for one task of a step on `count` nodes, one task each (tasks: another task count)."""
    return {
        "SLURM_JOB_ID": job,
        "SLURM_JOB_NODELIST": nodes,
        "SLURM_JOB_NUM_NODES": str(count),
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": nodes,
        "SLURM_STEP_NUM_NODES": str(count),
        "SLURM_STEP_NUM_TASKS": str(count if tasks is None else tasks),
        "SLURM_NNODES": str(count),
        "SLURM_NODEID": str(node_id),
    }


def test_outside_slurm_nothing_is_taken():
    assert from_slurm({"PATH": "/usr/bin"}) is None


@pytest.mark.parametrize(
    "text,hosts",
    [
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a,b", ["a", "b"]),
        ("gpu-a[1-2],gpu-b3", ["gpu-a1", "gpu-a2", "gpu-b3"]),
        ("localhost,localhost", ["localhost", "localhost"]),  # a simulated step: duplicates kept, in order
    ],
)
def test_node_lists_expand_in_slurm_s_order(text, hosts):
    assert expand_nodes("SLURM_STEP_NODELIST", text) == hosts


def test_a_step_on_several_nodes_gives_nodes_rank_and_rendezvous():
    found = from_slurm(step("node[01-03,07]", node_id=2, count=4, job="123456"))
    assert (found.nnodes, found.node_rank, found.master_addr, found.master_port) == (4, 2, "node01", 23456)
    assert found.taken == (
        "4 node(s) (SLURM_STEP_NUM_NODES)",
        "node rank 2 (SLURM_NODEID)",
        "master address node01 (first of SLURM_STEP_NODELIST=node[01-03,07])",
        "master port 23456 (from SLURM_JOB_ID)",
    )


def test_given_values_win_and_agreeing_ones_are_fine():
    env = step("a,b", node_id=1, count=2)
    found = from_slurm(env, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500)
    assert (found.nnodes, found.node_rank, found.master_addr, found.master_port) == (2, 1, "10.0.0.1", 29500)
    assert found.taken == ()


def test_one_node_keeps_the_launcher_s_own_rendezvous():
    # on one node the launcher's defaults (loopback, a free port) are right: two launches in one job never collide
    found = from_slurm(step("node7", node_id=0, count=1))
    assert (found.nnodes, found.node_rank, found.master_addr, found.master_port) == (1, 0, None, None)


def test_the_port_is_the_same_on_every_node_and_outside_the_ephemeral_range():
    ports = {slurm_port("987654") for _ in range(3)}
    assert ports == {SLURM_PORT_BASE + 7654}
    assert slurm_port("987655") == SLURM_PORT_BASE + 7655  # consecutive jobs sharing a node differ
    assert SLURM_PORT_BASE <= slurm_port("not-a-number") < SLURM_PORT_BASE + SLURM_PORT_SPAN < 32768


@pytest.mark.parametrize(
    "env,given,match",
    [
        (step("a,b", 0, 2), {"nnodes": 3}, r"nnodes: 3, but this srun step of SLURM job 4242 runs on 2 node\(s\)"),
        (step("a,b", 0, 2), {"nnodes": 1}, r"nnodes: 1, but this srun step .* run srun with --nodes=1"),
        (step("a,b", 1, 2), {"node_rank": 0}, r"node_rank: 0, but SLURM numbers this node 1 \(SLURM_NODEID=1\)"),
        (step("a,b", 0, 2, tasks=8), {}, r"SLURM_STEP_NUM_TASKS: this srun step runs 8 tasks on 2 node\(s\).*"),
        ({**step("a,b", 0, 2), "SLURM_STEP_NODELIST": "a[1-"}, {}, r"SLURM_STEP_NODELIST: cannot read the node list"),
        ({**step("a,b", 0, 2), "SLURM_STEP_NUM_NODES": "3"}, {}, r"names 2 host\(s\) \('a,b'\) but SLURM_STEP_NUM"),
        ({**step("a,b", 0, 2), "SLURM_NODEID": "x"}, {}, r"SLURM_NODEID: expected a count, got 'x'"),
        ({k: v for k, v in step("a,b", 0, 2).items() if k != "SLURM_NODEID"}, {}, "SLURM_NODEID: not set"),
    ],
    ids=["more-nodes", "fewer-nodes", "node-rank", "tasks-per-node", "bad-list", "count", "bad-id", "no-id"],
)
def test_a_contradiction_or_a_broken_environment_is_one_clear_error(env, given, match):
    with pytest.raises(ValueError, match=match):
        from_slurm(env, **given)


def test_a_missing_node_list_is_needed_only_for_the_master_address():
    env = {k: v for k, v in step("a,b", 1, 2).items() if "NODELIST" not in k}
    with pytest.raises(ValueError, match=r"master_addr: SLURM job 4242 names no nodes"):
        from_slurm(env)
    assert from_slurm(env, master_addr="a").master_addr == "a"


def test_the_batch_script_of_a_multi_node_job_runs_this_node_alone_and_says_so(caplog):
    batch = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0"}
    with caplog.at_level(logging.WARNING, logger="dpkit"):
        found = from_slurm(batch)
    assert (found.nnodes, found.node_rank, found.master_addr, found.master_port) == (1, 0, None, None)
    assert "SLURM job 77 has 2 nodes, but this runs outside srun: only this node starts processes" in caplog.text
    # asked for two nodes there, it still finds the rendezvous in the job's node list
    found = from_slurm(batch, nnodes=2)
    assert (found.nnodes, found.node_rank, found.master_addr, found.master_port) == (2, 0, "n1", slurm_port("77"))


def test_launch_refuses_a_contradiction_before_anything_starts(tmp_path, monkeypatch):
    for name in [name for name in os.environ if name.startswith("SLURM")]:
        monkeypatch.delenv(name)
    for name, value in step("a,b", 1, 2).items():
        monkeypatch.setenv(name, value)
    script = tmp_path / "never.py"
    script.write_text("open('ran', 'w').close()\n")
    with pytest.raises(ValueError, match="node_rank: 0, but SLURM numbers this node 1"):
        launch(str(script), nproc_per_node=1, node_rank=0, slurm=True)
    # without slurm=True (the library's default) SLURM's variables are not read
    with pytest.raises(ValueError, match="master_addr/master_port: required when nnodes > 1"):
        launch(str(script), nproc_per_node=1, nnodes=2, node_rank=0)
    assert not (tmp_path / "ran").exists()


# --- two simulated nodes over loopback ------------------------------------------------------------------

SUMS = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from dpkit.launch.worker import exit_worker

    dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK and WORLD_SIZE from the launcher
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    seen = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": total.item(),
            "node": int(os.environ["GROUP_RANK"]), "master": os.environ["MASTER_ADDR"]}
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as handle:
        json.dump(seen, handle)
    dist.destroy_process_group()
    exit_worker(0)  # as dpkit's own workers leave: without torch's interpreter teardown (seconds of CPU in all)
""")


def test_two_launchers_in_a_simulated_two_node_srun_step_make_one_world(tmp_path):
    job = next(j for j in range(9_000_000, 9_010_000) if not port_in_use("127.0.0.1", slurm_port(str(j))))
    script = tmp_path / "sums.py"
    script.write_text(SUMS)
    clean = {name: value for name, value in os.environ.items() if not name.startswith("SLURM")}

    def node(node_id: int) -> subprocess.Popen:
        env = {**clean, **step("localhost,localhost", node_id, count=2, job=str(job))}
        return subprocess.Popen(
            [sys.executable, "-m", "dpkit.cli.main", "launch", "--nproc-per-node", "auto", str(script), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    nodes = [node(0), node(1)]
    outputs = []
    try:
        for process in nodes:
            outputs.append(process.communicate(timeout=120))
    finally:
        for process in nodes:
            if process.poll() is None:
                process.kill()
    for node_id, (process, (_, err)) in enumerate(zip(nodes, outputs)):
        assert process.returncode == 0, f"node {node_id}:\n{err[-3000:]}"
    per_node = processes_per_node("auto")
    world = 2 * per_node
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]
    assert [s["rank"] for s in seen] == list(range(world))
    assert {s["world_size"] for s in seen} == {world}
    assert {s["sum"] for s in seen} == {world * (world + 1) / 2}  # every rank's all_reduce saw all the others
    assert [s["node"] for s in seen] == [rank // per_node for rank in range(world)]
    assert {s["master"] for s in seen} == {"localhost"}
    taken = [line for line in outputs[1][1].splitlines() if "from SLURM job" in line]
    assert taken == [
        f"INFO dpkit: launch: from SLURM job {job}: 2 node(s) (SLURM_STEP_NUM_NODES); node rank 1 (SLURM_NODEID); "
        f"master address localhost (first of SLURM_STEP_NODELIST=localhost,localhost); "
        f"master port {slurm_port(str(job))} (from SLURM_JOB_ID)"
    ], outputs[1][1]
