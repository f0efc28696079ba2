"""The launcher's side of the workers' stacks: where a worker's Python code is, read from the dump faulthandler
writes (worker.py: on STACK_SIGNAL, which the hang watch sends, and on a fatal signal such as gloo's abort), and
the last collective a worker published before it ended (heartbeat.py keeps it in a file next to its stacks)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sysconfig
import time

from dpkit.launch.environment import collective_file, stack_file
from dpkit.launch.worker import STACK_SIGNAL

_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.*)$')
_LIBRARY_DIRS = tuple(
    os.path.join(path, "")
    for path in {
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # dpkit
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["platlib"],
    }
)
STACK_WAIT_SECONDS = 2.0


def user_frames(dump: str) -> list[tuple[str, str]]:
    """From one faulthandler dump of every thread (a fatal one: from its "Fatal Python error" on), the frames of
    the user's code of the thread that has some (the current one first), innermost first: (`train.py:12 in main`,
    the function that line is calling, or "")."""
    last_dump = dump[max(dump.rfind("Fatal Python error"), 0) :]
    threads: list[tuple[bool, list[tuple[str, str, str]]]] = []
    for line in last_dump.splitlines():
        if line.startswith(("Current thread ", "Thread ")):
            threads.append((line.startswith("Current"), []))
            continue
        match = _FRAME.match(line)
        if match and threads:
            threads[-1][1].append((match["file"], match["line"], match["function"]))
    chosen: list[tuple[str, str]] = []
    for _current, frames in sorted(threads, key=lambda t: not t[0]):
        found = []
        for index, (file, line, function) in enumerate(frames):
            if _is_user_file(file):
                callee = frames[index - 1][2] if index > 0 else ""
                callee = "" if callee.startswith("_") else callee  # torch's Module.__call__ machinery says nothing
                found.append((f"{os.path.basename(file)}:{line} in {function}", callee))
        if found:
            chosen = found
            break
    return chosen


def _is_user_file(path: str) -> bool:
    return not path.startswith("<") and not path.startswith(_LIBRARY_DIRS)


def describe_frames(frames: list[tuple[str, str]], limit: int = 3) -> str:
    if not frames:
        return "no Python frame of the user's code"
    where, callee = frames[0]
    text = where + (f" (calling {callee})" if callee else "")
    if len(frames) > 1:
        text += ", called from " + ", ".join(where for where, _ in frames[1:limit])
    return text


def request_stacks(folder: str, pids: dict[int, int], wait_seconds: float = STACK_WAIT_SECONDS) -> dict[int, str]:
    """Ask each rank (rank -> pid, on this node) for its stacks (STACK_SIGNAL) and return where its user code is,
    for the ranks that answered within wait_seconds."""
    sizes: dict[int, int] = {}
    for rank, pid in pids.items():
        path = stack_file(folder, rank)
        if not os.path.exists(path):
            continue
        sizes[rank] = os.path.getsize(path)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, STACK_SIGNAL)
    found: dict[int, str] = {}
    deadline = time.monotonic() + wait_seconds
    while sizes and time.monotonic() < deadline:
        for rank in list(sizes):
            path = stack_file(folder, rank)
            if os.path.getsize(path) > sizes[rank]:
                time.sleep(0.05)  # faulthandler writes a dump in a few writes
                with open(path, errors="replace") as handle:
                    handle.seek(sizes.pop(rank))
                    found[rank] = describe_frames(user_frames(handle.read()))
        time.sleep(0.02)
    return found


def last_collectives(folder: str, ranks: list[int]) -> dict[int, dict]:
    """The last collective each of these ranks (on this node) published before it ended, where known."""
    found = {}
    for rank in ranks:
        with contextlib.suppress(OSError, ValueError), open(collective_file(folder, rank)) as handle:
            found[rank] = json.load(handle)
    return found


def fatal_stack(folder: str, rank: int) -> str | None:
    """Where the user's code of a rank that died of a fatal signal (gloo's abort) was, from the dump faulthandler
    wrote then; None without one."""
    path = stack_file(folder, rank)
    try:
        with open(path, errors="replace") as handle:
            text = handle.read()
    except OSError:
        return None
    if "Fatal Python error" not in text:
        return None
    return describe_frames(user_frames(text))
