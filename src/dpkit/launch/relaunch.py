"""One relaunch for every command that needs one process per device: the same command, one level down.

`dpkit train --strategy ddp`, `dpkit profile --strategy ddp` and `dpkit bench` (for its ddp contenders)
start themselves again under `launch`, once per device; the workers see `relaunched()` and leave the
reporting (signals, the summary) to the process that started them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dpkit.launch.environment import RELAUNCHED_VARIABLE


@dataclass(frozen=True)
class Command:
    """What runs in each process: `python -m module *argv` (e.g. dpkit.cli.main with a command line)."""

    module: str
    argv: tuple[str, ...] = ()


def relaunch(command: Command, processes: int, **launch_options: Any) -> None:
    """Run `command` once per process through `launch` (launch_options: max_restarts=, hang_timeout_seconds=,
    force=, log_dir=, …); returns when every worker exited with 0, raises as `launch` does.

    The workers write to the console themselves, without rank prefixes (unless launch_options ask for them):
    only rank 0 of a relaunched command speaks, and its lines (the progress bar, `dpkit train: error: …`) read
    as the command's own."""
    from dpkit.launch.agent import launch  # torch's launcher: only a process that starts workers needs it

    launch_options.setdefault("rank_prefix", False)
    launch(
        command.module,
        list(command.argv),
        nproc_per_node=processes,
        module=True,
        worker_environment={RELAUNCHED_VARIABLE: "1"},
        **launch_options,
    )


def relaunched() -> bool:
    """Whether this process is a worker of a relaunched command (its launching command reports for it)."""
    return os.environ.get(RELAUNCHED_VARIABLE) == "1"
