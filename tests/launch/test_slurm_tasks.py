"""Two launchers on one node are refused however SLURM says that a step runs more tasks than nodes."""

from __future__ import annotations

import pytest

from dpkit.launch.slurm import from_slurm

ONE_NODE_STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "a",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "a",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_NODEID": "0",
}


def test_a_step_of_more_tasks_than_nodes_is_refused_from_slurm_ntasks_alone():
    # an older srun, or an environment made by hand: the task count only in SLURM_NTASKS, this task's in PROCID
    env = {**ONE_NODE_STEP, "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
    with pytest.raises(ValueError) as refused:
        from_slurm(env)
    assert str(refused.value) == (
        "SLURM_NTASKS: this srun step runs 2 tasks on 1 node(s) (this is task 1, SLURM_PROCID), but dpkit launch "
        "starts each node's processes itself: run one task per node (srun --ntasks-per-node=1)"
    )
    # one task per node is the way to run it
    assert from_slurm({**env, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).nnodes == 1


def test_a_node_rank_taken_from_slurm_is_named_by_its_variable():
    # a batch script on a 4-node job told to launch 2 nodes from the node SLURM numbers 3: the rank is SLURM's
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "3"}
    with pytest.raises(ValueError) as refused:
        from_slurm(env, nnodes=2)
    assert str(refused.value).startswith("SLURM_NODEID: 3, but the launch has 2 node(s) (0 … 1); "), refused.value
