"""Inside a SLURM allocation: the nodes, this node's rank and the rendezvous, from SLURM's environment.

One `srun` task per node runs `dpkit launch`, which starts that node's processes. Inside such a step SLURM tells
each task the step's nodes (SLURM_STEP_NODELIST, e.g. `gpu[01-04]`, expanded by python-hostlist), their count
(SLURM_STEP_NUM_NODES) and this node's index among them (SLURM_NODEID). Node 0, the first host of the list,
hosts the rendezvous, on a port every node derives from the job id alone, so the nodes agree without talking.

Outside a step (the batch script itself, an salloc shell) only this node runs the command: the launch is one node
unless told otherwise, and says so when the job has more. Given arguments win; inside a step, a node count or
node rank that contradicts SLURM is refused, since the step's tasks would wait for nodes that never come or
share a rank.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("dpkit")

# the rendezvous port of a job: 20000 + the job id modulo 10000. Below Linux's ephemeral ports (32768 on), where
# free_port's and outgoing connections' ports come from; consecutive jobs sharing a node get different ports.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 10000


@dataclass(frozen=True)
class SlurmRendezvous:
    """Where this node meets the others, with SLURM's values for what the caller left unset."""

    job_id: str
    nnodes: int
    node_rank: int
    master_addr: str | None  # None: the launcher's default (this machine, on one node)
    master_port: int | None
    taken: tuple[str, ...]  # what came from SLURM, in words, for the log


def slurm_port(job_id: str) -> int:
    """The rendezvous port every node of SLURM job `job_id` derives alike."""
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return SLURM_PORT_BASE + number % SLURM_PORT_SPAN


def expand_nodes(name: str, text: str) -> list[str]:
    """A SLURM node list (`node[01-03,07],gpu5`) as host names, in SLURM's order; `name` is its variable."""
    import hostlist

    try:
        hosts = hostlist.expand_hostlist(text, allow_duplicates=True)
    except hostlist.BadHostlist as error:
        raise ValueError(f"{name}: cannot read the node list {text!r} ({error})") from None
    if not hosts:
        raise ValueError(f"{name}: the node list is empty, expected host names such as node[01-04]")
    return hosts


def _count(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    text = value.split("(")[0]  # SLURM writes repeated counts as `2(x3)`
    if not text.isdigit():
        raise ValueError(f"{name}: expected a count, got {value!r}")
    return int(text)


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    return next(((name, env[name]) for name in names if env.get(name)), None)


def _one_task_per_node(env: Mapping[str, str], nodes: int | None) -> None:
    """Refuse a step of more tasks than nodes: each task would start a launcher, two on one node. The step's task
    count, else SLURM_NTASKS (inside a step, the step's; an older srun or a hand-made environment gives it alone)."""
    name = next((n for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if env.get(n)), None)
    tasks = _count(env, name) if name else None
    if nodes is not None and tasks is not None and tasks > nodes:
        task = f" (this is task {env['SLURM_PROCID']}, SLURM_PROCID)" if env.get("SLURM_PROCID") else ""
        raise ValueError(
            f"{name}: this srun step runs {tasks} tasks on {nodes} node(s){task}, but dpkit launch starts each "
            "node's processes itself: run one task per node (srun --ntasks-per-node=1)"
        )


def from_slurm(
    environ: Mapping[str, str] | None = None,
    *,
    nnodes: int | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> SlurmRendezvous | None:
    """The rendezvous inside a SLURM job (None outside one): the given values, and SLURM's for the others.

    Inside an srun step: nnodes from SLURM_STEP_NUM_NODES, node_rank from SLURM_NODEID; with several nodes,
    master_addr is the first host of SLURM_STEP_NODELIST and master_port `slurm_port(SLURM_JOB_ID)`. A given
    nnodes or node_rank that contradicts the step, or a step of more tasks than nodes, is a ValueError.
    """
    env = os.environ if environ is None else environ
    job = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")
    if job is None:
        return None
    job_id = job[1]
    taken: list[str] = []
    in_step = bool(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))
    node_list = _first(env, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST") if in_step else None
    if not in_step:
        node_list = _first(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    hosts = expand_nodes(*node_list) if node_list else None
    slurm_rank = _count(env, "SLURM_NODEID")
    if in_step:
        count_name = next((n for n in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES") if env.get(n)), None)
        step_nodes = _count(env, count_name) if count_name else (len(hosts) if hosts else None)
        if step_nodes is not None and hosts is not None and node_list is not None and len(hosts) != step_nodes:
            raise ValueError(
                f"{node_list[0]}: names {len(hosts)} host(s) ({node_list[1]!r}) but {count_name}={step_nodes}; "
                "SLURM's variables disagree"
            )
        _one_task_per_node(env, step_nodes)
        if step_nodes is not None:
            if nnodes is not None and nnodes != step_nodes:
                raise ValueError(
                    f"nnodes: {nnodes}, but this srun step of SLURM job {job_id} runs on {step_nodes} node(s) "
                    f"({count_name}={step_nodes}); run srun with --nodes={nnodes}, "
                    "or let the node count come from SLURM"
                )
            if nnodes is None:
                nnodes = step_nodes
                taken.append(f"{step_nodes} node(s) ({count_name})")
        if slurm_rank is not None:
            if node_rank is not None and node_rank != slurm_rank:
                raise ValueError(
                    f"node_rank: {node_rank}, but SLURM numbers this node {slurm_rank} (SLURM_NODEID={slurm_rank}); "
                    "inside an srun step the node rank comes from SLURM"
                )
            if node_rank is None:
                node_rank = slurm_rank
                taken.append(f"node rank {slurm_rank} (SLURM_NODEID)")
        elif node_rank is None and (nnodes or 1) > 1:
            raise ValueError(
                f"SLURM_NODEID: not set in this srun step of SLURM job {job_id}, which runs on {nnodes} nodes; "
                "give this node's rank"
            )
    else:
        job_nodes = _count(env, "SLURM_JOB_NUM_NODES") or _count(env, "SLURM_NNODES") or 1
        if nnodes is None and job_nodes > 1:
            log.warning(
                "launch: SLURM job %s has %d nodes, but this runs outside srun: only this node starts processes; "
                "start it with `srun --ntasks-per-node=1 dpkit launch …` to use every node",
                job_id,
                job_nodes,
            )
        if node_rank is None and (nnodes or 1) > 1 and slurm_rank is not None:
            node_rank = slurm_rank
            taken.append(f"node rank {slurm_rank} (SLURM_NODEID)")
    nnodes = 1 if nnodes is None else nnodes
    node_rank = 0 if node_rank is None else node_rank
    if any("(SLURM_NODEID)" in what for what in taken) and not 0 <= node_rank < nnodes:
        # the user never typed this rank: name where it came from, not node_rank / --node-rank
        raise ValueError(
            f"SLURM_NODEID: {node_rank}, but the launch has {nnodes} node(s) (0 … {nnodes - 1}); SLURM's variables "
            "and the node count disagree: give the node count SLURM runs, or this node's rank"
        )
    if nnodes > 1:  # on one node the launcher's own defaults (this machine, a free port) are right
        if master_addr is None:
            if hosts is None or node_list is None:  # hosts come from the node list
                raise ValueError(
                    f"master_addr: SLURM job {job_id} names no nodes (SLURM_STEP_NODELIST / SLURM_JOB_NODELIST unset); "
                    "give node 0's address"
                )
            master_addr = hosts[0]
            taken.append(f"master address {hosts[0]} (first of {node_list[0]}={node_list[1]})")
        if master_port is None:
            master_port = slurm_port(job_id)
            taken.append(f"master port {master_port} (from SLURM_JOB_ID)")
    return SlurmRendezvous(job_id, nnodes, node_rank, master_addr, master_port, tuple(taken))


def slurm_gpus_on_node(environ: Mapping[str, str] | None = None) -> int | None:
    """The GPUs SLURM gave this node (SLURM_GPUS_ON_NODE), None when it says nothing."""
    env = os.environ if environ is None else environ
    try:
        return _count(env, "SLURM_GPUS_ON_NODE")
    except ValueError:
        return None
