"""`dpkit <command>`: dispatch to one module per subcommand; errors become one line in the command's flags."""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.metadata
import logging
import sys
import textwrap

import torch

from dpkit.cli import vocabulary
from dpkit.cli.flags import Flags
from dpkit.cli.vocabulary import VOCABULARY, Parser, UsageError, verb_parsers
from dpkit.errors import DpkitError, is_said_by_every_rank
from dpkit.launch import StoppedBySignal, launched
from dpkit.launch.environment import process_place
from dpkit.launch.worker import exit_worker
from dpkit.recipe.sources import UserCodeError, first_line, raised_in_your_code, your_frames
from dpkit.strategies import available_strategies

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
    "catalogue": "dpkit.cli.catalogue",
}

# the strategies named from the registry, so that the overview never counts fewer than `dpkit train` offers
OVERVIEW = textwrap.fill(
    "Data-parallel training for PyTorch on GPUs and on virtual CPU devices (cpu:0, cpu:1, ...): "
    f"{len(available_strategies())} strategies behind one training loop ({', '.join(available_strategies())}), "
    "measured per device and per phase, planned before you buy, and checkpoints that resume exactly. Every verb "
    "has --help with examples; a flag means the same in every verb that has it (docs/cli.md).",
    width=106,
)

FIRST_STEPS = """\
first steps:
  dpkit demo                                            # digits on 2 virtual CPU devices (or every GPU)
  dpkit train --strategy ddp --devices 2 --out runs/a   # a real run: model.pt, metrics.csv, resumable state
  dpkit profile --strategy dp --devices 2               # memory by category and time by phase, per device
  dpkit plan --model gpt2-124m --gpu h100-sxm --batch-size-per-device 8
  dpkit catalogue gpus                                  # the GPUs, links and networks plan knows"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dpkit", description=OVERVIEW, epilog=FIRST_STEPS)
    parser.add_argument("--version", action="version", version=f"dpkit {_version()} (torch {torch.__version__})")
    add_log_level(parser, argparse_default=False)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS.values():
        module = importlib.import_module(module_name)
        sub = module.add_parser(subparsers)
        add_log_level(sub, argparse_default=argparse.SUPPRESS)  # -v / -q after the verb too
        sub.set_defaults(_run=module.run, _flags=Flags.of(sub, getattr(module, "SPELLED", None)))
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("dpkit")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing it
        return "(not installed)"


def add_log_level(parser: argparse.ArgumentParser, *, argparse_default: object) -> None:
    """-v / -q, before or after the verb and its action (`ckpt inspect`): the copies leave the overview's value
    unless given."""
    level = parser.add_mutually_exclusive_group()
    for flag, short in (("--verbose", "-v"), ("--quiet", "-q")):
        action = level.add_argument(
            short, flag, action="store_true", default=argparse_default, help=VOCABULARY[flag].split(" (")[0]
        )
        vocabulary._tag(action, flag)
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for nested in getattr(action, "choices", {}).values():
            if isinstance(nested, argparse.ArgumentParser):
                add_log_level(nested, argparse_default=argparse.SUPPRESS)


def refuse_unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> None:
    """Arguments no parser took: refused by the verb they were given to (its prog and its --help), with the
    nearest flag it has when one is close (`--stratgy` -> did you mean --strategy?)."""
    verbs = verb_parsers(parser)
    name = " ".join(part for part in (args.command, getattr(args, "action", None)) if part)
    verb = verbs.get(name) or verbs.get(args.command or "") or parser
    message = f"unrecognized arguments: {' '.join(unknown)}"
    flags = sorted(option for option in verb._option_string_actions if option.startswith("--"))
    for given in unknown:
        if given.startswith("--"):
            nearest = difflib.get_close_matches(given.split("=")[0], flags, n=1, cutoff=0.6)
            if nearest:
                message += f"; did you mean {nearest[0]}?"
                break
    raise UsageError(verb.prog, message)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            refuse_unknown(parser, args, unknown)
    except UsageError as error:
        print(error.line(), file=sys.stderr)
        return 2
    if args.command is None:  # plain `dpkit`: the overview
        parser.print_help()
        return 0
    args.argv = list(
        sys.argv[1:] if argv is None else argv
    )  # a command that relaunches itself reuses its own command line
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
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
    except Exception as error:
        yours = raised_in_your_code(error)
        if yours is not None:  # the user's own code raised it: theirs, where their code raised it
            logging.getLogger("dpkit").debug("the exception of your code", exc_info=yours)
            said = first_line(error) if yours is not error else f"{type(error).__name__}: {first_line(error)}"
            print(
                f"dpkit {args.command}: error in your code: {said} "
                f"(last frames of your code: {your_frames(yours)}; -v prints the traceback)",
                file=sys.stderr,
            )
            return 1
        if not isinstance(error, (ValueError, TypeError, FileNotFoundError, DpkitError)):
            raise
        if isinstance(error, UserCodeError):  # said in one line already; -v adds the user's traceback
            logging.getLogger("dpkit").debug("the exception of your code", exc_info=error.__cause__)
        if launched() and process_place().rank != 0 and is_said_by_every_rank(error):
            return getattr(error, "exit_code", 2)  # every rank met it alike: rank 0 says it
        if str(error):  # an empty message: the processes this command started said why
            print(f"dpkit {args.command}: error: {args._flags.message(str(error))}", file=sys.stderr)
        return getattr(error, "exit_code", 2)


def run_as_program() -> None:
    """`python -m dpkit …` / `python -m dpkit.cli.main …`: run the command and leave with its exit code (a
    launched worker leaves without interpreter teardown: exit_worker)."""
    exit_code = main()
    if launched():
        exit_worker(exit_code)
    sys.exit(exit_code)


if __name__ == "__main__":
    run_as_program()
