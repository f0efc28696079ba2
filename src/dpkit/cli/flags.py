"""The command line's words for what the library calls arguments.

Library errors name the Python argument (`nproc_per_node: expected a positive int, got 0`, `… pass
force=True`); the `dpkit` command says the same in flags (`--nproc-per-node: …`, `… pass --force`). Each
verb's flags come from its own parser (an option's dest names the argument it sets), plus the library
arguments a verb spells differently (`hang_timeout_seconds` is `--hang-timeout`). Only the message's leading
argument names and `name=value` mentions are translated, never a bare word of the sentence.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_LEADING_NAMES = re.compile(r"^((?:[a-z_][a-z0-9_]*(?:\[\d+\])?)(?:/[a-z_][a-z0-9_]*(?:\[\d+\])?)*):")
_NAME_IS_VALUE = re.compile(r"(?<![\w.\-])([a-z_][a-z0-9_]*)=([^\s,;:)]+)")


class Flags:
    """A verb's flags by the library argument they set: `--flag`, and whether the flag takes no value."""

    def __init__(self, flags: Mapping[str, str], switches: frozenset[str] = frozenset()):
        self.flags = dict(flags)
        self.switches = switches

    @classmethod
    def of(cls, parser: argparse.ArgumentParser, spelled: Mapping[str, str] | None = None) -> Flags:
        flags, switches = {}, set()
        for action in parser._actions:
            longs = [option for option in action.option_strings if option.startswith("--")]
            if longs and action.dest != "help":
                flags[action.dest] = longs[0]
                if action.nargs == 0:
                    switches.add(action.dest)
        for argument, flag in (spelled or {}).items():
            flags[argument] = flag
            dest = next((d for d, f in flags.items() if f == flag and d != argument), None)
            if dest in switches:
                switches.add(argument)
        return cls(flags, frozenset(switches))

    def _flag(self, name: str) -> str | None:
        base, _, index = name.partition("[")
        flag = self.flags.get(base)
        return None if flag is None else flag + (f"[{index}" if index else "")

    def message(self, text: str) -> str:
        """A library error message in this verb's flags."""
        leading = _LEADING_NAMES.match(text)
        if leading:
            names = leading.group(1).split("/")
            flags = [self._flag(name) for name in names]
            known = [flag for flag in flags if flag]
            if len(known) == len(flags):
                text = "/".join(known) + text[leading.end(1) :]

        def mention(match: re.Match) -> str:
            name, value = match.group(1), match.group(2)
            flag = self.flags.get(name)
            if flag is None:
                return match.group(0)
            if name in self.switches:
                return flag if value == "True" else match.group(0)
            if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            return f"{flag} {value}"

        return _NAME_IS_VALUE.sub(mention, text)


Spec = TypeVar("Spec", bound="DataclassInstance")


def from_args(cls: type[Spec], args: argparse.Namespace, **given: Any) -> Spec:
    """An instance of the dataclass `cls` (a library spec or config) from parsed arguments: each field from the
    argument of the same name; `given` fields (the ones the command spells or shapes differently) as given."""
    values = {field.name: getattr(args, field.name) for field in dataclasses.fields(cls) if hasattr(args, field.name)}
    return cls(**{**values, **given})
