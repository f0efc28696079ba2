"""The command line's vocabulary: a flag means one thing in every verb that has it.

Each verb adds its shared flags through the functions here, so `--devices` is parsed the same way in
`train`, `profile` and `demo`, and the verbs that compare device counts (`bench`, `plan`) say so with
another name, `--device-counts`. VOCABULARY is the table docs/cli.md prints and tests/cli/test_vocabulary.py
checks against every verb's parser.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from dpkit.precision import PRECISIONS
from dpkit.strategies import available_strategies

# where a flag goes: a verb's parser, or one of its argument groups (mutually exclusive ones included)
ParserOrGroup = argparse.ArgumentParser | argparse._ArgumentGroup

# flag -> what it means, the same in every verb that has it (docs/cli.md lists the verbs)
VOCABULARY = {
    "--accelerator": "where to run: auto (every GPU if any, else virtual CPU devices), cpu or cuda",
    "--devices": "the devices to use: a count (2), CUDA indices (0,1), names (cpu:0,cpu:1) or auto "
    "(every GPU, else 2 virtual CPU devices)",
    "--device-counts": "device counts to compare, comma-separated (1,2,4)",
    "--nproc-per-node": "processes to start on this node, one per device: a count or auto (every GPU, else 2)",
    "--strategy": "one strategy: " + ", ".join(available_strategies()) + " (train: also auto)",
    "--strategies": "strategies to compare, comma-separated",
    "--compress": "gradient compression: none, bf16, fp16, powersgd or powersgd:R (rank R; powersgd is rank 2); "
    "bf16/fp16 under ddp, zero, fsdp, hsdp and replicated, powersgd where whole gradients are all-reduced (ddp, zero "
    "stage 1, replicated)",
    "--zero-stage": "zero: 1 shards the optimizer state (ddp's model), 2 the gradients too (default: 1)",
    "--shard-size": "hsdp: processes per shard group, the rest replicate (default: the processes of one node)",
    "--batch-size": "samples per forward over all devices, split across them (with --accumulate K a step takes K "
    "such batches)",
    "--batch-size-per-device": "samples per device per step; the global batch is this times the devices",
    "--accumulate": "micro-batches per optimizer step, the gradients exchanged once per step",
    "--precision": "numeric precision: " + ", ".join(PRECISIONS) + " (plan also knows tf32)",
    "--optimizer": "the optimizer: sgd (with --momentum), adamw or adam",
    "--lr": "the learning rate (the peak one with a schedule)",
    "--seed": "seed of the initial weights and of the batch order",
    "--compile": "torch.compile the model's forward under every strategy; BACKEND: torch.compile's backend "
    "(default inductor, which needs a C++ compiler on CPU; aot_eager needs none)",
    "--example": "a built-in example's model and data",
    "--model": "your model, as 'package.module:factory' (imported from the current folder first)",
    "--data": "your data, as 'package.module:loader'; loader(seed) returns x_train, y_train, x_test, y_test",
    "--input-shape": "the per-sample input shape, comma-separated (3,32,32)",
    "--steps": "optimizer steps (train: in total, a resumed run's included; profile, bench: measured)",
    "--warmup": "unmeasured steps before the measured ones",
    "--out": "the folder a run writes",
    "--json": "write the result as JSON to this file",
    "--png": "write the plots to this PNG file",
    "--link": "a catalogue link between the devices of a node (dpkit catalogue lists them)",
    "--catalogue": "a JSON or TOML file adding to or correcting the hardware catalogue",
    "--max-restarts": "restart the processes this many times after a failure",
    "--hang-timeout": "stop and name a process that makes no progress for this many seconds",
    "--force": "start more processes than a sane multiple of the CPU cores",
    "--no-progress": "hide the progress bars",
    "--verbose": "log at DEBUG level (-v), before or after the verb",
    "--quiet": "log warnings only (-q), before or after the verb",
}

AUTO_DEVICES = "auto"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and example epilogs keep their line breaks; an option's help ends with its default, unless it
    has none or already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or "default" in text
        ):
            return text
        return f"{text} (default: %(default)s)"


class UsageError(Exception):
    """A flag the parser refused; `dpkit` prints it in its one-line error style and exits 2."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog

    def line(self) -> str:
        return f"{self.prog}: error: {self} (see {self.prog} --help)"


class Parser(argparse.ArgumentParser):
    """dpkit's parsers: the help formatter above, and a usage error in dpkit's one-line style (UsageError)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        message = message.removeprefix("argument ")
        if message.startswith("-") and ": " in message:
            flags, _, rest = message.partition(": ")
            message = f"{flags.split('/')[-1]}: {rest}"  # '-v/--verbose' -> '--verbose'
        raise UsageError(self.prog, message)


def add_verb(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    summary: str,
    description: str,
    examples: Sequence[str],
) -> argparse.ArgumentParser:
    """A verb's parser: a one-line summary for the overview, a paragraph for its --help, and examples after."""
    epilog = "examples:\n" + "\n".join(f"  {example}" for example in examples)
    return subparsers.add_parser(name, help=summary, description=description, epilog=epilog)


def _tag(action: argparse.Action, flag: str) -> argparse.Action:
    setattr(action, "vocabulary", flag)  # noqa: B010 (an attribute of dpkit's, not argparse's); tests/cli/test_vocabulary.py: every verb's shared flag comes from here
    return action


def add_accelerator(parser: ParserOrGroup) -> None:
    _tag(
        parser.add_argument(
            "--accelerator", default="auto", choices=["auto", "cpu", "cuda"], help=VOCABULARY["--accelerator"]
        ),
        "--accelerator",
    )


def add_devices(parser: ParserOrGroup, default: str = AUTO_DEVICES) -> None:
    _tag(parser.add_argument("--devices", default=default, help=VOCABULARY["--devices"]), "--devices")


def device_counts(text: str) -> list[int]:
    return comma_ints(text, what="device counts such as 1,2,4", minimum=1)


def add_device_counts(parser: ParserOrGroup, default: str) -> None:
    _tag(
        parser.add_argument("--device-counts", default=default, type=device_counts, help=VOCABULARY["--device-counts"]),
        "--device-counts",
    )


def nproc_per_node(text: str) -> int | str:
    if str(text).strip() == "auto":
        return "auto"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive count of processes or auto, got {text!r}") from None


def add_nproc_per_node(parser: ParserOrGroup, default: int | str | None, help_more: str = "") -> None:
    _tag(
        parser.add_argument(
            "--nproc-per-node",
            default=default,
            type=nproc_per_node,
            metavar="N|auto",
            help=VOCABULARY["--nproc-per-node"] + help_more,
        ),
        "--nproc-per-node",
    )


def add_strategy(parser: ParserOrGroup, default: str | None, *, auto: str = "", help_more: str = "") -> None:
    """--strategy: one of the registry's; with `auto` (its help) also "auto", chosen for the model and devices."""
    choices = [*available_strategies(), *(["auto"] if auto else [])]
    text = "the strategy" + help_more + (f"; auto: {auto}" if auto else "")
    _tag(parser.add_argument("--strategy", default=default, choices=choices, help=text), "--strategy")


def compression_text(text: str) -> str:
    """--compress's value, checked as the library checks compress= (one line naming the flag and what is accepted)."""
    from dpkit.strategies.compression import parse_compression

    try:
        return str(parse_compression(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("compress: ")) from None


def add_compress(parser: ParserOrGroup) -> None:
    """--compress: the gradient compression (strategies/compression.py), checked before any work."""
    _tag(
        parser.add_argument(
            "--compress", default="none", type=compression_text, metavar="KIND", help=VOCABULARY["--compress"]
        ),
        "--compress",
    )


def add_strategy_settings(parser: ParserOrGroup) -> None:
    """--zero-stage and --shard-size: the options of zero and hsdp (a run's or a plan's)."""
    _tag(
        parser.add_argument("--zero-stage", type=int, choices=(1, 2), default=None, help=VOCABULARY["--zero-stage"]),
        "--zero-stage",
    )
    _tag(
        parser.add_argument(
            "--shard-size", type=positive_int, default=None, metavar="N", help=VOCABULARY["--shard-size"]
        ),
        "--shard-size",
    )


def strategy_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in available_strategies()]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"expected strategies from {', '.join(available_strategies())}, comma-separated, got {text!r}"
        )
    return names


def add_strategies(parser: ParserOrGroup) -> None:
    _tag(
        parser.add_argument(
            "--strategies",
            default=",".join(available_strategies()),
            type=strategy_list,
            help=VOCABULARY["--strategies"],
        ),
        "--strategies",
    )


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text}")
    return value


def add_batch_size(parser: ParserOrGroup, default: str) -> None:
    """--batch-size (global) or --batch-size-per-device, one of them; `global_batch` turns either into the global
    batch for a device count. `default` says in words what the verb does when neither is given."""
    group = parser.add_mutually_exclusive_group()
    _tag(
        group.add_argument(
            "--batch-size", type=positive_int, help=f"{VOCABULARY['--batch-size']} (default: {default})"
        ),
        "--batch-size",
    )
    _tag(
        group.add_argument("--batch-size-per-device", type=positive_int, help=VOCABULARY["--batch-size-per-device"]),
        "--batch-size-per-device",
    )


def global_batch(args: argparse.Namespace, devices: int, *, default: int) -> int:
    """The global batch on `devices` devices from --batch-size or --batch-size-per-device, else `default`."""
    if args.batch_size_per_device is not None:
        return args.batch_size_per_device * devices
    return args.batch_size if args.batch_size is not None else default


def add_accumulate(parser: ParserOrGroup) -> None:
    """--accumulate K: micro-batches per optimizer step (a run's, or a plan's)."""
    _tag(
        parser.add_argument("--accumulate", type=positive_int, default=1, metavar="K", help=VOCABULARY["--accumulate"]),
        "--accumulate",
    )


def add_precision(parser: ParserOrGroup, choices: Sequence[str] = PRECISIONS) -> None:
    _tag(
        parser.add_argument("--precision", default="32", choices=list(choices), help="numeric precision"),
        "--precision",
    )


def add_optimizer(parser: ParserOrGroup, default: str, choices: Sequence[str] = ("sgd", "adamw", "adam")) -> None:
    _tag(
        parser.add_argument("--optimizer", default=default, choices=list(choices), help="the optimizer"), "--optimizer"
    )


def add_seed(parser: ParserOrGroup) -> None:
    from dpkit.checks import MAX_SEED

    _tag(parser.add_argument("--seed", type=int, default=0, help=f"{VOCABULARY['--seed']}, 0 … {MAX_SEED}"), "--seed")


def add_compile(parser: ParserOrGroup) -> None:
    _tag(
        parser.add_argument(
            "--compile",
            nargs="?",
            const=True,
            default=None,
            metavar="BACKEND",
            help=VOCABULARY["--compile"] + "; docs/compile.md says where it pays",
        ),
        "--compile",
    )


def compile_option(value: bool | str | None) -> bool | dict[str, str] | None:
    """--compile: True (torch's default backend); --compile BACKEND: that backend; absent: None (eager)."""
    return {"backend": value} if isinstance(value, str) else value


def add_model_source(parser: ParserOrGroup, default_example: str, *, input_shape: bool = False) -> None:
    from dpkit.examples import EXAMPLES

    group = parser.add_argument_group("model and data")
    _tag(
        group.add_argument(
            "--example", default=default_example, help=f"{VOCABULARY['--example']}: {', '.join(sorted(EXAMPLES))}"
        ),
        "--example",
    )
    _tag(group.add_argument("--model", help=VOCABULARY["--model"]), "--model")
    _tag(group.add_argument("--data", help=VOCABULARY["--data"]), "--data")
    if input_shape:
        add_input_shape(group, " (with --model and no --data: synthetic inputs of this shape)")


def input_shape(text: str) -> tuple[int, ...]:
    return tuple(comma_ints(text, what="a per-sample shape such as 3,32,32", minimum=1))


def add_input_shape(parser: ParserOrGroup, help_more: str = "") -> None:
    _tag(
        parser.add_argument("--input-shape", type=input_shape, help=VOCABULARY["--input-shape"] + help_more),
        "--input-shape",
    )


def add_outputs(parser: ParserOrGroup, *, png: str | None = None) -> None:
    _tag(parser.add_argument("--json", help=VOCABULARY["--json"]), "--json")
    if png is not None:
        _tag(parser.add_argument("--png", help=f"{VOCABULARY['--png']}: {png}"), "--png")


def add_progress(parser: ParserOrGroup) -> None:
    _tag(parser.add_argument("--no-progress", action="store_true", help=VOCABULARY["--no-progress"]), "--no-progress")


def add_restarts(parser: ParserOrGroup, help_more: str = "") -> None:
    """--max-restarts, --hang-timeout and --force: what a verb that starts processes takes."""
    _tag(
        parser.add_argument("--max-restarts", type=int, default=0, help=VOCABULARY["--max-restarts"] + help_more),
        "--max-restarts",
    )
    _tag(
        parser.add_argument(
            "--hang-timeout", type=float, default=None, metavar="SECONDS", help=VOCABULARY["--hang-timeout"]
        ),
        "--hang-timeout",
    )
    _tag(parser.add_argument("--force", action="store_true", help=VOCABULARY["--force"]), "--force")


def comma_ints(
    text: str, *, what: str = "comma-separated integers such as 1,2,3", minimum: int | None = None
) -> list[int]:
    """'1,2,3' -> [1, 2, 3]; an argparse type error naming what would be accepted otherwise."""
    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or (minimum is not None and min(values) < minimum):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return values


def add_link(parser: ParserOrGroup, help_more: str = "") -> None:
    _tag(parser.add_argument("--link", help=VOCABULARY["--link"] + help_more), "--link")


def add_catalogue(parser: ParserOrGroup) -> None:
    _tag(parser.add_argument("--catalogue", help=VOCABULARY["--catalogue"]), "--catalogue")


def verb_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every verb's parser by name ('ckpt inspect' for a verb's action)."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found.update({f"{name} {inner}": p for inner, p in verb_parsers(sub).items()})
    return found


def vocabulary_table(parser: argparse.ArgumentParser) -> list[tuple[str, str, list[str]]]:
    """(flag, meaning, verbs that have it) for every flag of VOCABULARY: the table docs/cli.md shows."""
    verbs = verb_parsers(parser)
    rows = []
    for flag, meaning in VOCABULARY.items():
        having = [name for name, sub in verbs.items() if flag in sub._option_string_actions and " " not in name]
        rows.append((flag, meaning, having))
    return rows


def add_lr(parser: ParserOrGroup, default: float, help_more: str = "") -> None:
    _tag(parser.add_argument("--lr", type=float, default=default, help=VOCABULARY["--lr"] + help_more), "--lr")


def add_steps(parser: ParserOrGroup, default: int, help_text: str) -> None:
    _tag(parser.add_argument("--steps", type=positive_int, default=default, help=help_text), "--steps")


def add_warmup(parser: ParserOrGroup, default: int | None, help_text: str) -> None:
    _tag(parser.add_argument("--warmup", type=int, default=default, help=help_text), "--warmup")


def add_out(parser: ParserOrGroup, default: str, help_text: str) -> None:
    _tag(parser.add_argument("--out", default=default, help=help_text), "--out")
