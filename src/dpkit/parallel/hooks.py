"""The observation seam: parallel/ and the strategies announce what they do; whoever listens measures.

Nothing in parallel/ knows what a measurement is. It calls the functions below at the edges of its work,
and they forward to every registered listener (an `observe.Observer` while it is started, a test's
recorder, ...). With no listener registered each call costs one check of an empty tuple.

    handle = hooks.register(listener)     # listener: any object with some of the methods of Listener
    ...
    handle.remove()

Calls, all optional for a listener to implement:
    phase(name, device)          context manager around a phase run by the calling thread
                                 ("scatter", "replicate", "gather", "loss", "all_reduce", "optimizer", ...)
    replica(index, device)       context manager around a replica's job, entered in that replica's thread
    replica_phase(name)          context manager inside a replica's job that switches its phase ("loss", ...)
    handing_off(devices)         context manager in the calling thread around handing one job to each of
                                 two or more replica threads and waiting for them all (the replica runner)
    peer_wait()                  context manager inside a replica's job around a wait for other replicas
                                 (its turn, the gradient sum's queue, SyncBatchNorm's exchange)
    split(module, devices, output_device, rows)   a step's plan: rows per device (0: left out)
    outputs(outputs, devices, stop)               the replicas' outputs, whose autograd nodes belong to
                                                  `devices[i]` up to the nodes in `stop` (the inputs')
    span(name, device, start_seconds, seconds, hidden_seconds)
                                 a phase that ran outside the caller's flow (an asynchronous all-reduce),
                                 told once it finished; times from time.perf_counter(); `hidden_seconds`
                                 of it overlapped the caller's other work (backward)
    memory_level(device, category, nbytes)
                                 `device` now holds `nbytes` of `category` in storages resized in place,
                                 which no allocation shows (fsdp's gathered parameters); told at each change

A phase inside a replica's job (replica_phase, or phase with device None) belongs to that replica's device.
A strategy that runs its own replicas announces split() once per forward, runs its jobs through the replica
runner (which enters replica()), wraps each replica's backward in replica_phase("backward") and its
gradient exchange in phase("all_reduce"); observers see every optimizer.step() through torch's own hooks.

DataParallel(balance=...) chooses its chunk sizes from measured steps; what measures them is plugged in
here too (`set_balance_planner`; dpkit.observe plugs in its measured balance when dpkit is imported).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.autograd.graph import Node

    from dpkit.parallel.data_parallel import ChunkPlanner

T = TypeVar("T")

# listeners are duck-typed (any subset of Listener's methods): only looked up with getattr
_listeners: tuple[object, ...] = ()
_lock = threading.Lock()


class Listener(Protocol):  # documentation of the calls; a listener implements any subset
    def phase(self, name: str, device: torch.device | None) -> AbstractContextManager: ...
    def replica(self, index: int, device: torch.device) -> AbstractContextManager: ...
    def replica_phase(self, name: str) -> AbstractContextManager: ...
    def handing_off(self, devices: Sequence[torch.device]) -> AbstractContextManager: ...
    def peer_wait(self) -> AbstractContextManager: ...
    def split(
        self, module: nn.Module, devices: Sequence[torch.device], output_device: torch.device, rows: Sequence[int]
    ) -> None: ...
    def outputs(self, outputs: Sequence[Any], devices: Sequence[torch.device], stop: Sequence[Node]) -> None: ...
    def span(
        self, name: str, device: torch.device, start_seconds: float, seconds: float, hidden_seconds: float
    ) -> None: ...
    def memory_level(self, device: torch.device, category: str, nbytes: int) -> None: ...


class Handle:
    """Returned by register(); remove() unregisters (idempotent)."""

    def __init__(self, listener: object):
        self.listener = listener

    def remove(self) -> None:
        global _listeners
        with _lock:
            _listeners = tuple(x for x in _listeners if x is not self.listener)


def register(listener: object) -> Handle:
    global _listeners
    with _lock:
        if not any(x is listener for x in _listeners):
            _listeners = _listeners + (listener,)
    return Handle(listener)


def listeners() -> tuple[object, ...]:
    """The registered listeners, in registration order."""
    return _listeners


def listening() -> bool:
    """Whether anyone listens (callers skip preparing what only a listener would read)."""
    return bool(_listeners)


def _enter_all(method: str, *args: object) -> AbstractContextManager:
    listeners = _listeners
    if not listeners:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for listener in listeners:
        enter = getattr(listener, method, None)
        if enter is not None:
            stack.enter_context(enter(*args))
    return stack


def phase(name: str, device: torch.device | None = None) -> AbstractContextManager:
    return _enter_all("phase", name, device)


def replica(index: int, device: torch.device) -> AbstractContextManager:
    return _enter_all("replica", index, device)


def replica_phase(name: str) -> AbstractContextManager:
    return _enter_all("replica_phase", name)


def handing_off(devices: Sequence[torch.device]) -> AbstractContextManager:
    return _enter_all("handing_off", devices)


def peer_wait() -> AbstractContextManager:
    return _enter_all("peer_wait")


def _notify(method: str, *args: object) -> None:
    for listener in _listeners:
        notify = getattr(listener, method, None)
        if notify is not None:
            notify(*args)


def split(module: nn.Module, devices: Sequence[torch.device], output_device: torch.device, rows: Sequence[int]) -> None:
    _notify("split", module, devices, output_device, rows)


def outputs(outputs: Sequence[Any], devices: Sequence[torch.device], stop: Sequence[Node]) -> None:
    _notify("outputs", outputs, devices, stop)


def span(name: str, device: torch.device, start_seconds: float, seconds: float, hidden_seconds: float = 0.0) -> None:
    _notify("span", name, device, start_seconds, seconds, hidden_seconds)


def memory_level(device: torch.device, category: str, nbytes: int) -> None:
    _notify("memory_level", device, category, nbytes)


@contextlib.contextmanager
def listening_to(listener: T) -> Iterator[T]:
    """register(listener) for the duration of a with-block."""
    handle = register(listener)
    try:
        yield listener
    finally:
        handle.remove()


# --- what measures the steps of DataParallel(balance=...) ---------------------------------------------

_balance_planner: Callable[[str, Sequence[torch.device], Sequence[float | None]], ChunkPlanner] | None = None


def set_balance_planner(
    factory: Callable[[str, Sequence[torch.device], Sequence[float | None]], ChunkPlanner] | None,
) -> None:
    """Plug in what DataParallel(balance=mode) measures its steps with: `factory(mode, devices,
    max_bytes_per_device)` returns a ChunkPlanner. dpkit.observe plugs in its own when dpkit is imported."""
    global _balance_planner
    _balance_planner = factory


def balance_planner(
    mode: str, devices: Sequence[torch.device], max_bytes_per_device: Sequence[float | None]
) -> ChunkPlanner | None:
    """A ChunkPlanner for balance=mode from the plugged-in factory; None when nothing is plugged in."""
    return None if _balance_planner is None else _balance_planner(mode, devices, max_bytes_per_device)
