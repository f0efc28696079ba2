"""The collective record: every collective this process issues, numbered, with its op, size, step and the
user's line, in a small ring (the last RING_SIZE), so that a hang or a mismatch is named at the user's line.

One record per process (`RECORD`; a launched process is one rank). While a per-device strategy lives it
wraps torch.distributed's collective functions (`record_torch_collectives`), which catches what dpkit issues
(`engine.reduce`, barriers, `engine.close`) and what torch issues from Python for the strategy (FSDP2's
all-gathers and reduce-scatters); DDP's gradient buckets are recorded by ddp.py's comm hook. A collective
called inside another recorded one (all_gather_object's all_gathers) is part of it, not a second entry.

The call site is the first frame outside dpkit and torch (`train.py:31 in main`); where the stack has none
(a collective issued from autograd's own thread on a GPU) the strategy pins the site of the call that led
there (`RECORD.pinned`, around backward). Cost: a frame walk, two clock reads and a few attribute writes per
collective.

Each entry has the time it was issued (`issued`, time.perf_counter: the clock the observer's phase spans use, so
`dpkit profile --trace` puts the collectives on each rank's track beside its phases) and, once the call returned,
how long the call took to return on the issuing thread (`seconds`). An asynchronous collective (`async_op=True`,
DDP's gradient buckets) returns when it is enqueued: it is marked `async_op`, and its issuer records when it
completed (`completed`, set by ddp.py's bucket hook while a profile listens). On a GPU a collective returns
once it is enqueued on the stream, so `seconds` is its launch there. A profile keeps every entry of its observed
steps (`CollectiveRecord.keeping`), not only the last RING_SIZE.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from time import perf_counter  # the clock of the observer's phase spans (observe/timing.py)
from typing import Any

import torch

from dpkit.errors import DpkitError

RING_SIZE = 64
# while a profile observes its steps (tools/profile.py): every collective of a long profile of a large model
PROFILE_RING_SIZE = 1 << 16

# the collectives of torch.distributed that dpkit and FSDP2 call from Python (torch 2.13)
RECORDED_FUNCTIONS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "_broadcast_coalesced",
)


@dataclass(slots=True)
class Collective:
    """One collective as this rank issued it. `step`: the batch in hand when it was issued (batches the Engine's
    loaders yielded), or without an Engine loader the synchronised steps begun; `site`: the user's line;
    `issued`: time.perf_counter() when it was issued; `seconds`: how long the call took to return on the issuing
    thread (None until it returned); `async_op`: issued asynchronously, so it returned when enqueued; `completed`:
    time.perf_counter() when asynchronous work completed, where its issuer learns it (ddp's gradient buckets)."""

    sequence: int
    op: str
    size_bytes: int
    step: int
    site: str
    issued: float = 0.0
    seconds: float | None = None
    async_op: bool = False
    completed: float | None = None
    gradients: bool = False  # part of the gradients' exchange (issued in a strategy's backward)

    def describe(self) -> str:
        """`all_reduce of 4.0 MB (collective 12, step 3, train.py:31 in main)`"""
        size = f" of {_bytes_text(self.size_bytes)}" if self.size_bytes else ""
        return f"{self.op}{size} (collective {self.sequence}, step {self.step}, {self.site})"

    def as_dict(self) -> dict[str, Any]:
        """What identifies it (the heartbeat and the mismatch message carry this; not its times)."""
        return {"sequence": self.sequence, "op": self.op, "size_bytes": self.size_bytes, "step": self.step,
                "site": self.site}  # fmt: skip


def _bytes_text(size: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


class CollectiveRecord:
    """The ring of this process's last collectives and the counters that number them."""

    def __init__(self, capacity: int = RING_SIZE):
        self.entries: deque[Collective] = deque(maxlen=capacity)
        self.sequence = 0  # collectives recorded so far
        self.batches = 0  # batches the Engine's loaders yielded (the strategy counts them)
        # synchronised steps begun, as the strategy counts them (ddp: backwards that synchronise gradients; the
        # per-device strategies: a step's first all-gather, the first after gradients were reduce-scattered)
        self.steps = 0
        self._pinned: str | None = None
        # op -> a replacement called as carrier(original, entry, *args, **kwargs): a strategy that carries its
        # step marks in that collective (strategies/step_marks.py, FSDP's all-gathers)
        self.carriers: dict[str, Callable[..., Any]] = {}
        self.enabled = True  # off only to measure what the record costs (benchmarks/collective_record_cost.py)
        self._inside = threading.local()  # depth of recorded calls in this thread: inner calls are not entries
        # the bytes this process put into collectives since the record began (every entry's size, counted when it
        # returns), and of those the gradients' exchange (entries issued while `exchanging_gradients`; replicated,
        # which has no collective, counts what would cross between its devices with `count_bytes`)
        self.total_bytes = 0
        self.gradient_bytes = 0
        self._gradient_exchanges = 0  # exchanging_gradients blocks open (any thread)
        self._bytes_lock = threading.Lock()

    @property
    def step(self) -> int:
        return self.batches or self.steps

    def add(self, op: str, size_bytes: int = 0, site: str | None = None) -> Collective:
        self.sequence += 1
        entry = Collective(
            self.sequence, op, size_bytes, self.step, site or self._pinned or call_site(), perf_counter()
        )
        # (all-gathers in backward bring parameters: fsdp's units gathered again)
        entry.gradients = self._gradient_exchanges > 0 and not op.startswith("all_gather")
        self.entries.append(entry)
        return entry

    def count_bytes(self, size_bytes: int, *, gradients: bool) -> None:
        """Count bytes this process sent (or, for a strategy without collectives, would send between devices)."""
        with self._bytes_lock:
            self.total_bytes += size_bytes
            if gradients:
                self.gradient_bytes += size_bytes

    @contextlib.contextmanager
    def exchanging_gradients(self) -> Iterator[None]:
        """Collectives issued inside (from any thread: ddp's compressed buckets come from a worker) exchange
        gradients: their bytes count in `gradient_bytes` too (a strategy's backward)."""
        with self._bytes_lock:
            self._gradient_exchanges += 1
        try:
            yield
        finally:
            with self._bytes_lock:
                self._gradient_exchanges -= 1

    def step_begins(self, entry: Collective) -> Collective:
        """A synchronised step begins with this collective (already recorded): count it, and the entry carries
        the new step."""
        self.steps += 1
        entry.step = self.step
        return entry

    def last(self) -> Collective | None:
        try:
            return self.entries[-1]
        except IndexError:
            return None

    def reset(self) -> None:
        self.entries.clear()
        self.sequence = self.batches = self.steps = 0
        self.total_bytes = self.gradient_bytes = 0
        self._pinned = None
        self.carriers.clear()

    @contextlib.contextmanager
    def pinned(self, site: str | None = None) -> Iterator[str]:
        """Collectives issued inside get this call site (the caller's by default), from whatever thread."""
        before, self._pinned = self._pinned, site or self._pinned or call_site()
        try:
            yield self._pinned
        finally:
            self._pinned = before

    @contextlib.contextmanager
    def issuing(self, op: str, size_bytes: int | None = 0) -> Iterator[Collective | None]:
        """Record one collective around its call (when it returns, how long it took); collectives called inside
        it are part of it. size_bytes=None: its size is what the collectives called inside it in this thread
        contribute (a user's DDP comm hook, which decides what crosses)."""
        if not self.enabled:
            yield None
            return
        inside = self._inside
        depth = getattr(inside, "depth", 0)
        inside.depth = depth + 1
        entry = None
        try:
            if depth == 0:
                entry = inside.entry = self.add(op, size_bytes or 0)
                inside.sized_by_inner = size_bytes is None
            elif getattr(inside, "sized_by_inner", False) and inside.entry is not None:
                inside.entry.size_bytes += size_bytes or 0
            yield entry
        finally:
            inside.depth = depth
            if entry is not None:
                entry.seconds = perf_counter() - entry.issued
                inside.entry = None
                self.count_bytes(entry.size_bytes, gradients=entry.gradients)

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Collectives this thread issues inside are not entries (a background save's, on a group of its own): the
        record's numbering stays what every process's training issued."""
        inside = self._inside
        depth, entry = getattr(inside, "depth", 0), getattr(inside, "entry", None)
        inside.depth, inside.entry, inside.sized_by_inner = depth + 1, None, False
        try:
            yield
        finally:
            inside.depth, inside.entry = depth, entry

    def issued_async(self) -> None:
        """The collective this thread is issuing (the outermost recorded) was issued asynchronously: it returns
        when enqueued (DDP's gradient buckets, issued inside ddp.py's comm hook)."""
        entry = getattr(self._inside, "entry", None)
        if entry is not None:
            entry.async_op = True

    @contextlib.contextmanager
    def keeping(self, capacity: int) -> Iterator[int]:
        """Inside, the ring keeps the last `capacity` entries (at least its own capacity): a profile's observed
        steps, every one of their collectives. Yields the sequence so far: the window's entries are those after
        it (`since`). After, the ring is back to its capacity, with the last entries."""
        before = self.entries
        if before.maxlen is not None and before.maxlen < capacity:
            self.entries = deque(before, maxlen=capacity)
        try:
            yield self.sequence
        finally:
            if self.entries is not before:
                self.entries = deque(self.entries, maxlen=before.maxlen)

    def since(self, sequence: int) -> list[Collective]:
        """The entries kept that came after collective `sequence`, in order."""
        return [entry for entry in list(self.entries) if entry.sequence > sequence]


RECORD = CollectiveRecord()

_THIS_FILE = os.path.abspath(__file__)
_DPKIT_DIR = os.path.dirname(os.path.dirname(_THIS_FILE)) + os.sep
_LIBRARY_FILES = ("contextlib.py", "threading.py", "functools.py", "runpy.py")
_FROZEN = "<frozen "  # Python's own frozen modules (`<frozen runpy>` under `python -m`): never the user's line
# a launched worker's first code: the frames outside it are the launcher's `python -c` bootstrap, not the user's
_WORKER_FILE = os.path.join(_DPKIT_DIR, "launch", "worker.py")
# dpkit's commands, which drive the Engine as a user's script does: where dpkit itself called, their line
_DPKIT_DRIVERS = tuple(
    _DPKIT_DIR + part for part in ("tools" + os.sep, "plan" + os.sep, "cli" + os.sep, "recipe" + os.sep)
)


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def call_site(frame: Any = None) -> str:
    """`file.py:LINE in function` of the first frame outside dpkit and torch (and contextlib, runpy); where
    dpkit itself called (`dpkit train`, `dpkit profile`), the first in one of its commands (`profile.py:176 in
    step`), else the first outside torch; `?` with no Python frame at all."""
    frame = frame or sys._getframe(1)
    first_outside_torch = first_driver = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename == _WORKER_FILE:
            break
        in_torch = filename.startswith(_TORCH_DIR)
        if (
            not in_torch
            and filename != _THIS_FILE
            and not filename.endswith(_LIBRARY_FILES)
            and not filename.startswith(_FROZEN)
        ):
            if not filename.startswith(_DPKIT_DIR):
                return f"{os.path.basename(filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
            if first_outside_torch is None:
                first_outside_torch = frame
            if first_driver is None and filename.startswith(_DPKIT_DRIVERS):
                first_driver = frame
        frame = frame.f_back
    chosen = first_driver or first_outside_torch
    if chosen is None:
        return "?"
    return f"{os.path.basename(chosen.f_code.co_filename)}:{chosen.f_lineno} in {chosen.f_code.co_name}"


# the collectives whose first argument is their output: what this rank contributes is the input (the second)
_OUTPUT_FIRST = ("reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor", "all_gather_single")


def _size_bytes(name: str, args: tuple, kwargs: dict) -> int:
    """The bytes of the tensor (or list of tensors) this rank contributes: the first among the arguments, or the
    input of a collective that takes its output first."""
    if name.lstrip("_") in _OUTPUT_FIRST:
        given: Any = kwargs.get("input", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
        if given is not None and hasattr(given, "element_size") and hasattr(given, "numel"):
            return int(given.numel() * given.element_size())
    for value in (*args, *kwargs.values()):
        if hasattr(value, "element_size") and hasattr(value, "numel"):
            return int(value.numel() * value.element_size())
        if isinstance(value, (list, tuple)) and value and hasattr(value[0], "numel"):
            return int(sum(t.numel() * t.element_size() for t in value))
    return 0


def _recorded(name: str, function: Callable, record: CollectiveRecord) -> Callable:
    @functools.wraps(function)
    def collective(*args: Any, **kwargs: Any) -> Any:
        with record.issuing(name, _size_bytes(name, args, kwargs)) as entry:
            if kwargs.get("async_op"):  # the entry, or the one this call is part of (ddp's comm hook)
                record.issued_async()
            carrier = record.carriers.get(name) if entry is not None else None
            if carrier is not None:
                return carrier(function, entry, *args, **kwargs)
            return function(*args, **kwargs)

    collective.__dpkit_recorded__ = function  # type: ignore[attr-defined]
    return collective


_installed: list[tuple[Any, str, Callable]] = []  # (module, name, original) while recording
_install_lock = threading.Lock()


def record_torch_collectives(record: CollectiveRecord = RECORD) -> None:
    """Wrap torch.distributed's collectives (torch.distributed and distributed_c10d, where torch's own code
    looks them up) so each call is recorded; idempotent. `stop_recording_torch_collectives` undoes it."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    with _install_lock:
        if _installed:
            return
        wrappers: dict[int, Callable] = {}  # one wrapper per function, whichever module it is found in
        for module in (dist, c10d):
            for name in RECORDED_FUNCTIONS:
                original = getattr(module, name, None)
                if original is None or hasattr(original, "__dpkit_recorded__"):
                    continue
                wrapper = wrappers.setdefault(id(original), _recorded(name.lstrip("_"), original, record))
                _installed.append((module, name, original))
                setattr(module, name, wrapper)


def stop_recording_torch_collectives() -> None:
    with _install_lock:
        while _installed:
            module, name, original = _installed.pop()
            setattr(module, name, original)


def recording_torch_collectives() -> bool:
    return bool(_installed)


# --- the step check: every rank's place carried in a gradient synchronisation ------------------------------
# Each rank writes its (kind, batches, steps, sequence) into its own slots of a small tensor appended to a
# collective every rank makes each step (ddp: the first gradient bucket); the sum, the same on every rank, holds
# every rank's values exactly (one rank writes each slot), so all ranks see at once whether they agree.
MARK_FIELDS = ("kind", "batches", "steps", "sequence")
GRADIENTS, CLOSING = 1, 2  # the kinds: a step's gradient synchronisation, the closing collective (engine.close)


class CollectiveMismatch(DpkitError):
    """The ranks are at different steps (one skipped a step, issued another collective, or ran out of batches):
    found in the synchronisation itself, before any optimizer stepped on the mixed gradients."""


def mark_modulus(dtype: torch.dtype) -> int:
    """Values are carried modulo this: the integers the gradients' dtype holds exactly (256 in bfloat16)."""
    return int(min(1 << 20, 2 / torch.finfo(dtype).eps))


def step_marks(
    record: CollectiveRecord, kind: int, rank: int, world_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    modulus = mark_modulus(dtype)
    marks = torch.zeros(len(MARK_FIELDS) * world_size, dtype=dtype, device=device)
    values = (kind, record.batches % modulus, record.steps % modulus, record.sequence % modulus)
    start = len(MARK_FIELDS) * rank
    marks[start : start + len(MARK_FIELDS)] = torch.tensor(values, dtype=dtype)
    return marks


def read_marks(summed: torch.Tensor, world_size: int) -> list[tuple[int, ...]]:
    """Every rank's (kind, batches, steps, sequence) from the summed marks."""
    values = [round(v) for v in summed.detach().float().cpu().tolist()]
    width = len(MARK_FIELDS)
    return [tuple(values[r * width : (r + 1) * width]) for r in range(world_size)]


def mismatch_message(marks: list[tuple[int, ...]], entries: dict[int, dict[str, Any]]) -> str:
    """One line naming the ranks that differ from rank 0, and rank 0: where each is (its step, its collective
    and its call site, from `entries`, every rank's last record entry where known)."""
    odd = [rank for rank in range(len(marks)) if marks[rank] != marks[0]]
    same_step = all(marks[r][:3] == marks[0][:3] for r in odd)  # then they differ in their collectives

    def where(rank: int) -> str:
        kind, batches, steps, _ = marks[rank]
        entry = entries.get(rank, {})
        site = entry.get("site", "call site unknown")
        sequence = f", collective {entry['sequence']}" if same_step and "sequence" in entry else ""
        if kind == CLOSING:
            return f"ran out of batches after {steps} steps (engine.close{sequence}, {site})"
        return f"at step {entry.get('step', batches or steps)} ({entry.get('op', 'a collective')}{sequence}, {site})"

    verb = {r: "" if marks[r][0] == CLOSING else "is " for r in range(len(marks))}
    message = "; ".join(f"rank {r} {verb[r]}{where(r)}" for r in odd) + f" while rank 0 {verb[0]}{where(0)}"
    if any(mark[0] == CLOSING for mark in marks):
        return (
            f"{message}: the ranks' batch counts differ; give every rank the same number of batches "
            "(engine.setup_dataloader does)"
        )
    if same_step:
        return message + ": a rank issued a collective the others did not; stopped before the optimizer step"
    return message + ": a rank skipped a step; stopped before the optimizer step"
