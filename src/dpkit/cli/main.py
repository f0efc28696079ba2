"""`dpkit <command>`: dispatch to one module per subcommand; errors become one line in the command's flags."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from dpkit.cli.flags import Flags
from dpkit.errors import DpkitError
from dpkit.launch import StoppedBySignal, launched
from dpkit.launch.worker import exit_worker

# subcommand name -> module under dpkit.cli; each module defines add_parser(subparsers) and run(args) -> int, and
# may name the library arguments it spells differently from its flags' dests (SPELLED)
COMMANDS = {
    "demo": "dpkit.cli.demo",
    "profile": "dpkit.cli.profile",
    "train": "dpkit.cli.train",
    "launch": "dpkit.cli.launch",
    "bench": "dpkit.cli.bench",
    "plan": "dpkit.cli.plan",
    "doctor": "dpkit.cli.doctor",
    "ckpt": "dpkit.cli.ckpt",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpkit", description="Data-parallel training for PyTorch on GPUs and virtual CPU devices."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module_name in COMMANDS.values():
        module = importlib.import_module(module_name)
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run, _flags=Flags.of(sub, getattr(module, "SPELLED", None)))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(
        sys.argv[1:] if argv is None else argv
    )  # a command that relaunches itself reuses its own command line
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        # Ctrl-C: one line, the shell's 130, no traceback (a launched worker stays quiet: its launcher speaks)
        if not launched():
            print(f"dpkit {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except StoppedBySignal as stopped:
        if str(stopped):
            print(f"dpkit {args.command}: {args._flags.message(str(stopped))}", file=sys.stderr)
        return stopped.exit_code
    except (ValueError, TypeError, FileNotFoundError, DpkitError) as error:
        if str(error):  # an empty message: the processes this command started said why
            print(f"dpkit {args.command}: error: {args._flags.message(str(error))}", file=sys.stderr)
        return getattr(error, "exit_code", 2)


if __name__ == "__main__":
    exit_code = main()
    if launched():
        exit_worker(exit_code)
    sys.exit(exit_code)
