"""torchrun's spellings at `dpkit launch`, so that a command line written for torchrun runs as it is.

torchrun takes each flag with a hyphen or an underscore (`--nproc-per-node`, `--nproc_per_node`); dpkit's own
names (the hyphenated ones, in --help) stay the documented ones, and the other spellings set the same arguments
without showing in --help. The flags of torchrun that mean something here are translated to dpkit's:

- `--standalone`: this node alone, meeting at a free port on this machine (dpkit's one-node launch), also inside
  a SLURM job;
- `--rdzv-endpoint HOST[:PORT]`: where the nodes meet, dpkit's --master-addr and --master-port (torchrun's
  default port, 29400, when none is given);
- `--rdzv-backend static|c10d`: dpkit's nodes always meet with fixed ranks at node 0 (torch's static rendezvous);
  c10d, which would hand out node ranks, is taken where that changes nothing: on one node, or with --node-rank;
- `--rdzv-id`: a name for the job, which dpkit does not need (the address and port keep jobs apart);
- `--nnodes N` (or torchrun's `N:N`; an elastic range is refused), `--monitor-interval SECONDS`.

torchrun's other flags have no meaning here and are refused in one line, with dpkit's flag where one does the job.
"""

from __future__ import annotations

import argparse
from typing import Any

# torchrun's second spelling of a flag dpkit has -> dpkit's
ALIASES = {
    "--nproc_per_node": "--nproc-per-node",
    "--node_rank": "--node-rank",
    "--master_addr": "--master-addr",
    "--master_port": "--master-port",
    "--max_restarts": "--max-restarts",
    "--log_dir": "--log-dir",
}

# torchrun's flags that have no meaning at dpkit launch -> (whether it takes a value, what to use instead)
REFUSED = {
    "--start-method": (True, "dpkit starts every worker the same way"),
    "--role": (True, "dpkit's workers have one role"),
    "--event-log-handler": (True, "dpkit logs through logging's 'dpkit' logger"),
    "--no-python": (False, "the script is Python: a file, or a module with -m"),
    "--run-path": (False, "each worker runs the script in a process of its own"),
    "--redirects": (True, "use --log-dir DIR: every worker's stdout and stderr in files, also on the console"),
    "--tee": (True, "use --log-dir DIR: every worker's stdout and stderr in files, also on the console"),
    "--local-ranks-filter": (True, "use --show-ranks, which takes global ranks"),
    "--duplicate-stdout-filters": (True, "use --log-dir DIR to keep every worker's output"),
    "--duplicate-stderr-filters": (True, "use --log-dir DIR to keep every worker's output"),
    "--local-addr": (True, "the nodes meet at --master-addr"),
    "--logs-specs": (True, "use --log-dir DIR, in torchrun's layout"),
    "--numa-binding": (True, "dpkit binds no worker to CPUs"),
    "--signals-to-handle": (True, "Ctrl-C and SIGTERM to dpkit launch stop the workers (docs/faults.md)"),
    "--shutdown-timeout": (True, "dpkit stops the workers itself"),
    "--virtual-local-rank": (False, "each worker sees its own device index"),
    "--rdzv-conf": (True, "dpkit's rendezvous has no settings to give"),
}
SHORT_REFUSED = {"-r": "--redirects", "-t": "--tee"}
RENDEZVOUS_BACKENDS = ("static", "c10d")
TORCHRUN_ENDPOINT_PORT = 29400  # torchrun's port for a rendezvous endpoint given without one


def spellings(flag: str) -> list[str]:
    """A torchrun flag as torchrun takes it: with hyphens and with underscores."""
    return list(dict.fromkeys([flag, "--" + flag[2:].replace("-", "_")]))


class Refuse(argparse.Action):
    """A torchrun flag without a meaning here: one line naming it, and what to use instead."""

    def __init__(self, option_strings: list[str], dest: str, instead: str = "", **kwargs: Any) -> None:
        self.instead = instead
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: str | None = None) -> None:
        parser.error(f"{option}: torchrun's flag has no meaning at dpkit launch; {self.instead}")


def node_count(text: str) -> int:
    """--nnodes: a count (2), or torchrun's MIN:MAX with MIN = MAX (2:2); dpkit's groups are not elastic."""
    low, _, high = str(text).partition(":")
    try:
        counts = {int(low), int(high or low)}
    except ValueError:
        counts = set()
    if len(counts) != 1 or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"expected a node count such as 2 (torchrun's 2:2 too; a range of nodes is elastic, which dpkit launch is "
            f"not), got {text!r}"
        )
    return counts.pop()


def rendezvous_backend(text: str) -> str:
    if text not in RENDEZVOUS_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"expected static or c10d (dpkit's nodes meet at node 0 with fixed node ranks), got {text!r}"
        )
    return text


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def add_torchrun_spellings(parser: argparse.ArgumentParser) -> None:
    """torchrun's spellings, hidden from --help; call it after dpkit's own flags, whose dests and types the second
    spellings take, so that both parse alike."""
    hidden: dict[str, Any] = {"help": argparse.SUPPRESS, "default": argparse.SUPPRESS}
    for alias, flag in ALIASES.items():
        own = parser._option_string_actions[flag]
        typed: dict[str, Any] = {} if own.type is None else {"type": own.type}
        parser.add_argument(alias, dest=own.dest, metavar=own.metavar, **typed, **hidden)
    parser.add_argument("--standalone", action="store_true", **hidden)
    parser.add_argument(*spellings("--rdzv-endpoint"), dest="rdzv_endpoint", metavar="HOST[:PORT]", **hidden)
    parser.add_argument(*spellings("--rdzv-backend"), dest="rdzv_backend", type=rendezvous_backend, **hidden)
    parser.add_argument(*spellings("--rdzv-id"), dest="rdzv_id", **hidden)
    parser.add_argument(*spellings("--monitor-interval"), dest="monitor_interval", type=positive_seconds, **hidden)
    for flag, (takes_value, instead) in REFUSED.items():
        parser.add_argument(*spellings(flag), action=Refuse, instead=instead, nargs=None if takes_value else 0)
    for short, flag in SHORT_REFUSED.items():
        parser.add_argument(short, action=Refuse, instead=REFUSED[flag][1])


def resolve_torchrun_meaning(args: argparse.Namespace) -> dict[str, Any]:
    """The launch's arguments that torchrun's flags set (args updated in place: nnodes, node_rank, master_addr,
    master_port, no_slurm); a contradiction is a ValueError naming the flags. Returns the launch's keyword
    arguments that only torchrun's flags give (monitor_interval_seconds)."""
    if getattr(args, "standalone", False):
        _standalone(args)
    endpoint = getattr(args, "rdzv_endpoint", None)
    if endpoint is not None:
        _meet_at(args, endpoint)
    if getattr(args, "rdzv_backend", None) == "c10d" and (args.nnodes or 1) > 1 and args.node_rank is None:
        raise ValueError(
            f"--rdzv-backend: c10d would hand out node ranks, but dpkit's nodes meet at node 0 with fixed ranks; with "
            f"--nnodes {args.nnodes} give each node its --node-rank (0 … {args.nnodes - 1})"
        )
    interval = getattr(args, "monitor_interval", None)
    return {} if interval is None else {"monitor_interval_seconds": interval}


def _standalone(args: argparse.Namespace) -> None:
    """--standalone: this node alone, at a free port of this machine, whatever a SLURM job says."""
    given = {
        "--nnodes": args.nnodes not in (None, 1),
        "--node-rank": args.node_rank not in (None, 0),
        "--master-addr": args.master_addr is not None,
        "--master-port": args.master_port is not None,
        "--rdzv-endpoint": getattr(args, "rdzv_endpoint", None) is not None,
    }
    contradicting = [flag for flag, said in given.items() if said]
    if contradicting:
        raise ValueError(
            f"--standalone: runs this node alone, meeting at a free port on this machine, but "
            f"{' and '.join(contradicting)} say where several nodes meet; drop --standalone or "
            f"{' and '.join(contradicting)}"
        )
    args.nnodes, args.node_rank, args.no_slurm = 1, 0, True


def _meet_at(args: argparse.Namespace, endpoint: str) -> None:
    """--rdzv-endpoint HOST[:PORT]: dpkit's --master-addr and --master-port, unless those say otherwise."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        host, port = parse_rendezvous_endpoint(endpoint, default_port=TORCHRUN_ENDPOINT_PORT)
    except ValueError:
        host, port = "", 0
    if not host or not 0 < port < 65536:
        raise ValueError(f"--rdzv-endpoint: expected HOST or HOST:PORT, node 0's address, got {endpoint!r}")
    for flag, name, value in (("--master-addr", "master_addr", host), ("--master-port", "master_port", port)):
        given = getattr(args, name)
        if given is not None and given != value:
            raise ValueError(f"--rdzv-endpoint: {endpoint} says {value}, but {flag} says {given}; give one of them")
        setattr(args, name, value)
