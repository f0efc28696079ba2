"""Where a thread's work goes: the calling thread's shared dispatch mode, and a replica thread's scope.

The calling thread (the one that starts observers, runs the user's loop and, on CPU, autograd's backward)
has one dispatch mode shared by every started observer, so observers can start and stop in any order
(a dispatch mode can only leave the top of torch's mode stack). Each replica thread gets a
`ReplicaScope` per observer: its device and the phase it is in.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from dpkit.observe.memory import account_key, fresh_tensors
from dpkit.observe.timing import PhaseClock, _Open

if TYPE_CHECKING:
    from dpkit.observe.observer import Observer

# memory category of what a phase allocates
PHASE_CATEGORY = {
    "scatter": "other",
    "replicate": "parameters",
    "forward": "activations",
    "gather": "gathered_outputs",
    "loss": "loss",
    "backward": "gradients",
    "reduce": "gradients",
    "all_reduce": "gradients",
    "all_gather": "gathered_parameters",
    "reduce_scatter": "gradients",
    "optimizer": "optimizer_state",
    "average": "parameters",  # localsgd, diloco: the moves, the shared weights and diloco's outer step
}


def in_backward() -> bool:
    """Whether autograd's engine is running a backward in this thread."""
    return torch._C._current_graph_task_id() != -1


class CallingThreadTracker(TorchDispatchMode):
    """Charges what the calling thread allocates to each started observer's current (device, category)."""

    def __init__(self) -> None:
        super().__init__()
        self.observers: list[Observer] = []

    # torch.compile (issue 34): without this dynamo skips every frame entered under the mode, so replicas ran
    # eagerly. Caveat: a compiled graph's intermediate allocations (inside inductor's kernels) are not seen here.
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(
        self, func: OpOverload, types: Sequence[type], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for observer in self.observers:
            # a replica running in this thread (one device) charges its own work through its scope
            if not observer.memory or observer.replica_scope() is not None:
                continue
            for tensor in fresh_tensors(func, out):
                device, category = observer.calling_thread_where()
                observer.ledger.charge(tensor, account_key(tensor, device), category)
        return out


class SharedTracking:
    """The one CallingThreadTracker, entered while any observer is started.

    torch's mode stack is per thread, so only the thread that entered the tracker can exit it. An observer may
    be stopped elsewhere: by a finalizer that garbage collection runs in whatever thread allocated at that moment
    (a balance measurement whose wrapper was dropped). The tracker is then left idle (no observers: it passes
    every operator through) and the entering thread exits it at its next touch (join, leave or settle)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mode: CallingThreadTracker | None = None
        self._owner: int | None = None  # the thread that entered the mode

    def join(self, observer: Observer) -> None:
        with self._lock:
            if self._mode is None:
                self._mode = CallingThreadTracker()
                self._mode.__enter__()
                self._owner = threading.get_ident()
            self._mode.observers.append(observer)

    def leave(self, observer: Observer) -> None:
        with self._lock:
            mode = self._mode
            if mode is None or observer not in mode.observers:
                return
            mode.observers.remove(observer)
            if mode.observers:
                return
            if threading.get_ident() != self._owner:
                return  # idle until the entering thread settles it
            if _get_current_dispatch_mode() is not mode:
                raise RuntimeError(
                    "Observer.stop: another dispatch mode was entered after the observer started and is "
                    "still active; exit it before stopping the observer"
                )
            self._exit(mode)

    def settle(self) -> None:
        """Exit an idle tracker (its observers stopped from another thread), when this thread entered it and it
        is on top of this thread's modes."""
        with self._lock:
            mode = self._mode
            if (
                mode is not None
                and not mode.observers
                and threading.get_ident() == self._owner
                and _get_current_dispatch_mode() is mode
            ):
                self._exit(mode)

    def _exit(self, mode: CallingThreadTracker) -> None:
        self._mode, self._owner = None, None
        mode.__exit__(None, None, None)


# The only module-level state: torch's mode stack is per thread and ordered, so the observers of a
# process share one mode rather than each pushing its own.
TRACKING = SharedTracking()


class ReplicaScope:
    """One observer's state in one replica thread: its device and a stack of phases, the innermost timed."""

    def __init__(self, device: str, clock: PhaseClock | None):
        self.device = device
        self.clock = clock
        self.stack: list[tuple[str, str]] = [("forward", device)]
        self.open: _Open | None = None

    def where(self) -> tuple[str, str]:
        name, device = self.stack[-1]
        if name == "forward" and in_backward():  # a replica running its own backward (replicated)
            return device, "gradients"
        return device, PHASE_CATEGORY[name]

    def _restart(self) -> None:
        self.close()
        if self.clock is not None:
            name, device = self.stack[-1]
            self.open = self.clock.begin(device, name)

    def start(self) -> None:
        self._restart()

    def push(self, name: str, device: str | None = None) -> None:
        self.stack.append((name, device or self.device))
        self._restart()

    def pop(self) -> None:
        if len(self.stack) > 1:
            self.stack.pop()
        self._restart()

    def close(self) -> None:
        if self.open is not None and self.clock is not None:  # (an open span comes from the clock)
            self.clock.end(self.open)
            self.open = None
