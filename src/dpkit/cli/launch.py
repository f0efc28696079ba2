"""`dpkit launch`: run a training script once per device, on one node or several (torchrun underneath)."""

from __future__ import annotations

import argparse

from dpkit.devices import PROCESSES_PER_CORE
from dpkit.launch import launch

# library arguments this command spells differently
SPELLED = {"hang_timeout_seconds": "--hang-timeout"}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "launch",
        help="start one process per device (torch.distributed.run) for a script using strategy='ddp'",
        description="Start --nproc-per-node processes of `python script.py args…` on this node; with --nnodes > 1, "
        "start the same command on every node with its own --node-rank and the same --master-addr/--master-port.",
    )
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes (devices) on this node (default 1)")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0 … nnodes-1 (default 0)")
    parser.add_argument(
        "--master-addr", default=None, help="node 0's address (default 127.0.0.1; required with --nnodes > 1)"
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="node 0's rendezvous port (default: a free port; required with --nnodes > 1)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the worker group this many times after a failure (default 0); "
        "with `dpkit train --checkpoint-every K` the restarted group resumes from the last saved state; "
        "a worker exiting with 2 (bad input) or 3 (training diverged) is not retried: the launch exits with its code",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop and name a ddp rank that stays behind the others (no collective) for this long (default: off); "
        "a rank inside dpkit.launch.busy() (saving the state) is working, not hung",
    )
    parser.add_argument(
        "--force", action="store_true", help=f"start more than {PROCESSES_PER_CORE} processes per CPU core anyway"
    )
    parser.add_argument("-m", "--module", action="store_true", help="run `python -m script` instead of a file")
    parser.add_argument("script", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def run(args: argparse.Namespace) -> int:
    launch(
        args.script,
        args.script_args,
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        module=args.module,
        hang_timeout_seconds=args.hang_timeout,
        force=args.force,
    )
    return 0
