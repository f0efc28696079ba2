"""`dpkit launch`: run a training script once per device, on one node or several (torchrun underneath)."""

from __future__ import annotations

import argparse

from dpkit.cli.torchrun_flags import ALIASES, add_torchrun_spellings, node_count, resolve_torchrun_meaning
from dpkit.cli.vocabulary import add_nproc_per_node, add_restarts, add_verb, comma_ints
from dpkit.launch import launch

# library arguments this command spells differently; and dpkit's spelling, not torchrun's, names an argument that
# both set (`--nproc-per-node`, not `--nproc_per_node`)
SPELLED = {"hang_timeout_seconds": "--hang-timeout", **{flag[2:].replace("-", "_"): flag for flag in ALIASES.values()}}

DESCRIPTION = """\
Start --nproc-per-node processes of `python script.py args…` (or `python -m module` with -m) on this node,
on torch.distributed.run. With --nnodes > 1, start the same command on every node with its own --node-rank
and the same --master-addr/--master-port; inside a SLURM job, `srun` one task per node and these come from
SLURM. With more than one process, each line a worker writes starts with its rank ([rank1]: ...) on the
console; --log-dir keeps every worker's output in files, --show-ranks picks whose the console shows. The
script is checked before any process starts. torchrun's spellings work too (--standalone, --nproc_per_node,
--rdzv-endpoint, ...; docs/from-torchrun.md lists them), so a torchrun command line runs as it is."""

EXAMPLES = (
    "dpkit launch --nproc-per-node auto train.py --lr 0.1      # every GPU here, else 2 CPU processes",
    "dpkit launch --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr 10.0.0.1 --master-port 29500 train.py",
    "srun --ntasks-per-node=1 dpkit launch --nproc-per-node auto train.py   # in an sbatch script: nodes from SLURM",
    "dpkit launch --nproc-per-node 4 --log-dir logs --show-ranks 0 train.py  # all ranks in logs/, rank 0 on screen",
    "dpkit launch --standalone --nproc_per_node=2 train.py    # torchrun's spellings: the same as --nproc-per-node 2",
)


def ranks(text: str) -> list[int]:
    """--show-ranks: '0' or '0,4'."""
    return comma_ints(text, what="ranks such as 0 or 0,4", minimum=0)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = add_verb(
        subparsers,
        "launch",
        "start one process per device (torch.distributed.run) for a script using strategy='ddp'",
        DESCRIPTION,
        EXAMPLES,
    )
    add_nproc_per_node(parser, 1)
    nodes = parser.add_argument_group("nodes (inside a SLURM job these come from SLURM)")
    nodes.add_argument(
        "--nnodes", type=node_count, default=None, help="number of nodes (default: 1, or the srun step's)"
    )
    nodes.add_argument(
        "--node-rank", type=int, default=None, help="this node's rank, 0 … nnodes-1 (default: 0, or SLURM_NODEID)"
    )
    nodes.add_argument(
        "--master-addr",
        default=None,
        help="node 0's address (default: 127.0.0.1 on one node, SLURM's first node on several; "
        "else required with --nnodes > 1)",
    )
    nodes.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="node 0's rendezvous port (default: a free one on one node, one derived from SLURM_JOB_ID on several; "
        "else required with --nnodes > 1)",
    )
    nodes.add_argument(
        "--no-slurm",
        action="store_true",
        help="ignore SLURM's variables (default: inside a SLURM job, nodes, node rank and rendezvous come from them)",
    )
    output = parser.add_argument_group("the workers' output")
    output.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="also write each worker's stdout and stderr to files under "
        "DIR/dpkit_<random>/attempt_<restart>/<local rank>/ (default: no files)",
    )
    output.add_argument(
        "--show-ranks",
        type=ranks,
        default=None,
        metavar="RANKS",
        help="show only these ranks' output on the console, e.g. 0 or 0,4 (default: every rank's)",
    )
    output.add_argument(
        "--rank-prefix",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start each line of a worker's output with [rankN]: (default: on with more than one process in all)",
    )
    add_restarts(
        parser,
        "; with `dpkit train --checkpoint-every K` the restarted group resumes from the last saved state; a worker "
        "exiting with 2 (bad input) or 3 (training diverged) is not retried: the launch exits with its code",
    )
    parser.add_argument("-m", "--module", action="store_true", help="run `python -m script` instead of a file")
    add_torchrun_spellings(parser)
    parser.add_argument("script", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def run(args: argparse.Namespace) -> int:
    torchrun_only = resolve_torchrun_meaning(args)
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
        log_dir=args.log_dir,
        rank_prefix=args.rank_prefix,
        show_ranks=args.show_ranks,
        slurm=not args.no_slurm,
        **torchrun_only,
    )
    return 0
