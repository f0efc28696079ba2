"""The workers' output: on the console with each line's rank in front, and in files (`log_dir`).

torchrun's DefaultLogsSpecs decides the files: each worker's stdout and stderr are redirected to
LOG_DIR/<run id>_<random>/attempt_<restart>/<local rank>/stdout.log and stderr.log (a temporary folder, removed
after the launch, when no log_dir is given). The copy on the console is dpkit's, not torchrun's TailLog: TailLog
reads lines with universal newlines, so a progress bar (tqdm redraws its line after a carriage return) would
become one new line per refresh; `ConsoleCopy` copies the bytes as they come, with the rank's prefix at the
start of each line and after each carriage return, so rank 0's bar is redrawn in place.

With no prefix, no files and every rank shown, the workers write to the console themselves (plain torchrun).
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs

log = logging.getLogger("dpkit")

# copying a worker's output to the console lags its writes by at most this much
COPY_INTERVAL_SECONDS = 0.05
# a line left unfinished this long is copied anyway (a `print(..., end="")` before a long computation)
PARTIAL_LINE_SECONDS = 1.0


def rank_prefix_text(rank: int) -> str:
    """What comes before each line of a worker's output; torch's own traceback hook writes the same
    (distributed_c10d's excepthook), and a line that already starts with it is not prefixed twice."""
    return f"[rank{rank}]: "


class _Followed:
    """One worker's output file, copied to this process's stdout or stderr as it grows, whole lines at a time.

    A line is copied once it ends, so the lines of several ranks do not run into each other; except a line
    redrawn after a carriage return (a progress bar), copied as it comes, and one left open for longer than
    PARTIAL_LINE_SECONDS. `console` is shared by every followed file: which one left a stream in mid-line, so
    another's line starts on a line of its own."""

    def __init__(self, path: str, stream_name: str, prefix: str, console: dict[str, _Followed | None]):
        self.path, self.stream_name, self.prefix, self.console = path, stream_name, prefix, console
        self.handle: BinaryIO | None = None
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.line_start = True
        self.after_carriage_return = False  # the last line ended with \r: its next one redraws it
        self.held = ""  # an unfinished line, not copied yet
        self.held_since: float | None = None
        self.broken = False  # the console stream failed (a closed pipe): the file is still read, not copied

    def pump(self, final: bool = False) -> bool:
        """Copy what the file gained since the last call (final: everything up to its end, a line left open
        included); returns whether anything was read."""
        if self.handle is None:
            try:
                self.handle = open(self.path, "rb")  # noqa: SIM115 -- kept open while the worker writes
            except FileNotFoundError:
                return False  # the worker has not started yet
        read = False
        while True:
            data = self.handle.read(1 << 16)
            read = read or bool(data)
            last = final and not data
            self._write(self._lines(self.decoder.decode(data, final=last), last, time.monotonic()))
            if not data or not final:
                return read

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    def _lines(self, text: str, final: bool, now: float) -> str:
        """What to copy of `text` (after what was held), with the prefix at the start of each line."""
        text, self.held = self.held + text, ""
        out, i = [], 0
        while i < len(text):
            if self.line_start:
                if text[i] in "\r\n":  # an empty line, or a bar's carriage return: nothing to name
                    out.append(text[i])
                    self.after_carriage_return = text[i] == "\r"
                    i += 1
                    continue
                unfinished = text.find("\n", i) < 0 and text.find("\r", i) < 0
                waited = self.held_since is not None and now - self.held_since >= PARTIAL_LINE_SECONDS
                if unfinished and not (final or self.after_carriage_return or waited):
                    self.held = text[i:]
                    self.held_since = now if self.held_since is None else self.held_since
                    break
                self.held_since = None
                if not text.startswith(self.prefix, i):  # torch's traceback hook may have named the rank already
                    out.append(self.prefix)
                self.line_start = False
            ends = [at for at in (text.find("\n", i), text.find("\r", i)) if at >= 0]
            if not ends:
                out.append(text[i:])
                break
            end = min(ends) + 1
            out.append(text[i:end])
            i, self.line_start, self.after_carriage_return = end, True, text[end - 1] == "\r"
        if final and not self.line_start:
            out.append("\n")  # what follows (the launcher's summary) starts on a line of its own
            self.line_start = True
        return "".join(out)

    def _write(self, text: str) -> None:
        if not text or self.broken:
            return
        stream = sys.stdout if self.stream_name == "stdout" else sys.stderr
        other = self.console.get(self.stream_name)
        if other is not None and other is not self:
            text = "\n" + text  # another rank's line was left open (a bar): this one starts below it
            other.line_start = True
        try:
            try:
                stream.write(text)
            except UnicodeEncodeError:
                encoding = getattr(stream, "encoding", None) or "ascii"
                stream.write(text.encode(encoding, "replace").decode(encoding))
            stream.flush()
        except (OSError, ValueError):
            self.broken = True
        self.console[self.stream_name] = None if self.line_start else self


class ConsoleCopy:
    """Copies the followed files to the console as they grow, from one thread; `finish` copies the rest."""

    def __init__(self, interval_seconds: float = COPY_INTERVAL_SECONDS):
        self.interval_seconds = interval_seconds
        self._files: list[_Followed] = []
        self._console: dict[str, _Followed | None] = {}  # stream name -> the file that left it in mid-line
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, path: str, stream_name: str, prefix: str) -> None:
        with self._lock:
            self._files.append(_Followed(path, stream_name, prefix, self._console))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dpkit-console-copy", daemon=True)
                self._thread.start()

    def finish(self) -> None:
        """Copy what is left of every followed file (their writers have exited) and stop following them."""
        with self._lock:
            for followed in self._files:
                with contextlib.suppress(OSError):
                    followed.pump(final=True)
                followed.close()
            self._files.clear()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.finish()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                progressed = False
                for followed in self._files:
                    try:
                        progressed = followed.pump() or progressed
                    except OSError as error:  # never fail the launch over a copy; the files keep everything
                        log.debug("launch: copying %s stopped: %s", followed.path, error)
            if not progressed:
                self._stop.wait(self.interval_seconds)


def _check_ranks(show_ranks: Iterable[int], world_size: int) -> frozenset[int]:
    ranks = list(show_ranks)
    if not ranks:
        raise ValueError("show_ranks: expected at least one rank, e.g. [0], got none")
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(
                f"show_ranks: {rank!r} is not a rank of this launch; its ranks are 0 … {world_size - 1} "
                f"({world_size} processes in all)"
            )
    return frozenset(ranks)


def _check_log_dir(log_dir: str | os.PathLike) -> str:
    path = os.fspath(log_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"log_dir: {path!r} is a file; expected a folder (made when missing)")
    return path


class WorkerOutput:
    """Where a launch sends its workers' output; a context manager around the launch.

    rank_prefix: `[rankN]: ` before each line on the console (None: when the launch has more than one process in
    all); log_dir: keep every worker's stdout and stderr in files there; show_ranks: the global ranks whose output
    the console shows (None: all).
    """

    def __init__(
        self,
        *,
        world_size: int,
        log_dir: str | os.PathLike | None = None,
        rank_prefix: bool | None = None,
        show_ranks: Iterable[int] | None = None,
    ):
        if rank_prefix is not None and not isinstance(rank_prefix, bool):
            raise TypeError(f"rank_prefix: expected True, False or None (more than one process), got {rank_prefix!r}")
        self.show_ranks = None if show_ranks is None else _check_ranks(show_ranks, world_size)
        self.log_dir = None if log_dir is None else _check_log_dir(log_dir)
        self.rank_prefix = world_size > 1 if rank_prefix is None else rank_prefix
        self.passthrough = not self.rank_prefix and self.log_dir is None and self.show_ranks is None
        self.attempt_dir: str | None = None  # the folder of the last attempt's files
        self._copy = ConsoleCopy()
        self._scratch: str | None = None

    def __enter__(self) -> WorkerOutput:
        if self.log_dir is not None:
            try:
                os.makedirs(self.log_dir, exist_ok=True)
            except OSError as error:
                raise ValueError(
                    f"log_dir: cannot make the folder {self.log_dir!r} ({error.strerror or error})"
                ) from None
        elif not self.passthrough:
            self._scratch = tempfile.mkdtemp(prefix="dpkit-launch-")
        return self

    def __exit__(self, *exc: object) -> None:
        self._copy.close()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def logs_specs(self) -> LogsSpecs:
        """torchrun's LogsSpecs for the agent (inside the `with`)."""
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

        if self.passthrough:  # the console, and no files (not even torchrun's temporary folder)
            return DefaultLogsSpecs(log_dir=os.devnull)
        output = self

        class RankLogsSpecs(DefaultLogsSpecs):
            def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
                destinations = super().reify(envs)
                output._attempt_started(envs, destinations)
                return destinations

        return RankLogsSpecs(log_dir=self.log_dir or self._scratch, redirects=Std.ALL)

    def _attempt_started(self, envs: dict[int, dict[str, str]], destinations: LogsDest) -> None:
        """A (re)started worker group: the last group's files are copied to their end, this group's followed."""
        self._copy.finish()
        for local_rank, env in sorted(envs.items()):
            rank = int(env["RANK"])
            if self.show_ranks is None or rank in self.show_ranks:
                prefix = rank_prefix_text(rank) if self.rank_prefix else ""
                self._copy.follow(destinations.stdouts[local_rank], "stdout", prefix)
                self._copy.follow(destinations.stderrs[local_rank], "stderr", prefix)
        if destinations.stdouts:
            self.attempt_dir = os.path.dirname(os.path.dirname(destinations.stdouts[min(destinations.stdouts)]))
        if self.log_dir is not None and self.attempt_dir:
            ranks = sorted(int(env["RANK"]) for env in envs.values())
            log.info(
                "launch: the output of rank(s) %s is in %s/<local rank>/stdout.log and stderr.log",
                _ranges(ranks),
                self.attempt_dir,
            )

    def where(self, failed_ranks: Iterable[int]) -> str:
        """Where the failure summary sends the reader for the failed workers' own output."""
        hidden = sorted(r for r in set(failed_ranks) if self.show_ranks is not None and r not in self.show_ranks)
        files = self.attempt_dir if self.log_dir is not None else None
        if not hidden:
            return "each worker's own output is above" + (f", and in {files}" if files else "")
        names = ", ".join(map(str, hidden))
        shown = ",".join(map(str, sorted(self.show_ranks or ())))
        if files:
            return f"the output of rank(s) {names} is in {files}, not above (show_ranks={shown})"
        return f"the output of rank(s) {names} was not shown (show_ranks={shown}); log_dir=DIR keeps every rank's"


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(parts)
