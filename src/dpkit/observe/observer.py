"""`Observer`: per-device memory by category and time by phase, around any step of any strategy.

    with dpkit.observe.Observer() as obs:
        loss = dp(x, target=y)
        with obs.phase("backward"):
            loss.backward()
        optimizer.step()
    print(obs.report().format_table())

While started, an Observer is a listener of the observation seam (dpkit.parallel.hooks): DataParallel
and the strategies announce their phases, replica jobs, splits and outputs there, and the observer turns
them into accounts. How work is attributed to devices on virtual CPU devices (all tensors report `cpu`):
- a replica's thread charges what it allocates to its own device (forward -> activations, a loss computed
  inside the replica -> loss, a phase announced inside the job -> that phase's category);
- the calling thread charges to the phase's device (replicate -> parameters of that replica, gather ->
  gathered_outputs on the output device, optimizer step -> optimizer_state), else to the home device;
- autograd runs CPU backward in the calling thread, so the nodes a replica's forward created are marked
  with its device (graph.py); everything else in backward (the loss on gathered outputs, accumulation into
  the original parameters, i.e. the reduction) is the home device's, where it lives on GPUs too.
On CUDA the device is the tensor's own, the peak is the allocator's, and phases are timed with events.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from dpkit.observe.cuda import AllocatorPeaks
from dpkit.observe.graph import BackwardMarker
from dpkit.observe.memory import CATEGORIES, AllocationTracker, MemoryLedger, account_key, device_key
from dpkit.observe.optimizers import OptimizerWatch
from dpkit.observe.report import DeviceReport, Report
from dpkit.observe.step_split import OBSERVER, StepSplit
from dpkit.observe.threads import PHASE_CATEGORY, TRACKING, ReplicaScope, in_backward
from dpkit.observe.timing import PHASES, PhaseClock
from dpkit.parallel import hooks


def active() -> tuple[Observer, ...]:
    """The started observers; empty (and cheap to ask) when nothing is being measured."""
    TRACKING.settle()  # a tracker left idle by an observer stopped from another thread
    return tuple(listener for listener in hooks.listeners() if isinstance(listener, Observer))


class Observer:
    """Measure memory by category and time by phase, per device, while started.

    Args:
        device: the home device, where the calling thread's work is charged (default: the output
            device of the first DataParallel call, else cpu:0).
        memory: keep per-device memory accounts (a dispatch mode in every observed thread).
        timing: time phases (host timers on CPU, CUDA events on GPU).
        trace: keep the spans for `Report.save_trace`.
        models, optimizers: charge their existing parameters, gradients and state from the start; a model
            given as (module, device) is charged to that device (a replica's copy).
        backward_by_device: mark the autograd nodes of DataParallel's replicas with their devices, so that
            the backward the calling thread runs for them is timed and charged there. Marking costs Python
            work per node in every step (milliseconds for a model of many small layers); without it that
            backward is the home device's. Leave it off, with memory off too, to time a launch-bound step
            by thread (Report.threads) as it runs unobserved.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        memory: bool = True,
        timing: bool = True,
        trace: bool = True,
        models: Iterable[nn.Module | tuple[nn.Module, Any]] = (),
        optimizers: Iterable[torch.optim.Optimizer] = (),
        backward_by_device: bool = True,
    ):
        self.home = None if device is None else device_key(device)
        self.memory = memory
        self.backward_by_device = backward_by_device
        self.timing = timing
        self.trace = trace
        self._initial_models = list(models)
        self._initial_optimizers = list(optimizers)
        self.ledger = MemoryLedger()
        self.clock = PhaseClock(keep_spans=trace)
        self.devices: list[str] = []  # in the order they were announced or watched
        self.rows: dict[str, int] = {}
        self.steps = 0
        self.hidden_seconds: dict[str, dict[str, float]] = {}  # device -> phase -> seconds overlapped
        self.backward = BackwardMarker(self.clock if timing else None, self.home_device)
        self.optimizer_watch = OptimizerWatch(self)
        self.allocator_peaks = AllocatorPeaks()
        self.step_split = StepSplit() if timing else None  # the step by thread (step_split.py)
        self._thread = threading.local()  # .phases: this thread's phase stack; .scope: its replica scope
        self._handles: list[RemovableHandle] = []  # gradient hooks of watched parameters
        self._watched: set[int] = set()
        self._listening: hooks.Handle | None = None
        self._started = False
        self._devices_lock = threading.Lock()  # replica threads announce devices too

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> Observer:
        if self._started:
            raise RuntimeError("Observer.start: already started; use a new Observer per measurement")
        self._started = True
        self.clock.origin, self.clock.origin_unix_seconds = time.perf_counter(), time.time()
        self.allocator_peaks.start(alone=not active())
        if self.step_split is not None:
            self.step_split.start()
        if self.memory:  # the calling thread's dispatch mode only keeps memory accounts
            TRACKING.join(self)
        self.optimizer_watch.start()
        self._listening = hooks.register(self)
        for model in self._initial_models:
            module, device = model if isinstance(model, tuple) else (model, None)
            self.watch(module, device)
        for optimizer in self._initial_optimizers:
            self.watch_optimizer(optimizer, self.optimizer_watch.device_of(optimizer))
        return self

    def stop(self) -> None:
        if self._listening is None:
            return
        self._listening.remove()
        self._listening = None
        self.optimizer_watch.stop()
        self.backward.close()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        TRACKING.leave(self)
        self.clock.resolve()
        if self.step_split is not None:
            self.step_split.stop()

    @property
    def optimizers_seen(self) -> weakref.WeakSet[torch.optim.Optimizer]:
        """The optimizers that stepped while observed (a WeakSet)."""
        return self.optimizer_watch.seen

    def __enter__(self) -> Observer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- where this thread's work goes -----------------------------------------------------------
    def home_device(self) -> str:
        if self.home is None:
            self.home = self.devices[0] if self.devices else "cpu:0"
        return self.home

    def replica_scope(self) -> ReplicaScope | None:
        """This observer's scope in the current thread, if a replica's job runs here."""
        return getattr(self._thread, "scope", None)

    def _phase_stack(self) -> list[tuple[str, str, Any, bool]]:
        stack = getattr(self._thread, "phases", None)
        if stack is None:
            stack = self._thread.phases = []
        return stack

    def calling_thread_where(self) -> tuple[str, str]:
        """(device, category) of what the calling thread allocates now."""
        stack = self._phase_stack()
        if stack and stack[-1][3]:  # a phase opened inside backward (fsdp's gathers) names what it allocates
            name, device, _, _ = stack[-1]
            return device, PHASE_CATEGORY[name]
        node = self.backward.current()
        if node is not None:
            return node[0], "gradients"
        if in_backward():  # outside any marked node
            return self.home_device(), "gradients"
        if stack:
            name, device, _, _ = stack[-1]
            return device, PHASE_CATEGORY[name]
        return self.home_device(), "other"

    def _note_device(self, key: str) -> None:
        if key not in self.devices:
            with self._devices_lock:
                if key not in self.devices:
                    self.devices.append(key)

    # ---- phases (seam calls and direct use) ------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str, device: torch.device | str | None = None) -> Iterator[None]:
        """Time `name` on `device` and charge this thread's allocations to it. The device defaults to the
        replica's inside a replica's job, else to the home device."""
        if name not in PHASES:
            raise ValueError(f"phase: unknown phase {name!r}; use one of {', '.join(PHASES)}")
        key = None if device is None else device_key(device)
        off_home_before = self.backward.seconds_off_home
        self.enter_phase(name, key)
        try:
            yield
        finally:
            self.leave_phase(name, off_home_before)

    def enter_phase(self, name: str, key: str | None) -> Any:
        """Open a phase in this thread (pair with leave_phase); returns its timing token."""
        scope = self.replica_scope()
        if scope is not None:
            scope.push(name, key)
            return None
        key = self.home_device() if key is None else key
        self._note_device(key)
        stack = self._phase_stack()
        nested = any(entry[0] == name for entry in stack)  # e.g. optimizer hooks inside a caller's phase
        token = self.clock.begin(key, name) if self.timing and not nested else None
        stack.append((name, key, token, in_backward()))
        if self.step_split is not None:
            self.step_split.enter(name)
        return token

    def leave_phase(self, name: str, off_home_before: float | None = None) -> None:
        scope = self.replica_scope()
        if scope is not None:
            if scope.stack[-1][0] == name:
                scope.pop()
            return
        stack = self._phase_stack()
        if not stack or stack[-1][0] != name:
            return
        _, key, token, _ = stack.pop()
        if self.step_split is not None:
            self.step_split.leave(name)
        if token is None:
            return
        if name == "backward" and token.start_event is None and off_home_before is not None:
            # other devices' backward nodes were timed on their own: the rest is this device's
            wall = time.perf_counter() - token.host_start
            self.clock.add(
                key, name, token.host_start, max(0.0, wall - (self.backward.seconds_off_home - off_home_before))
            )
        else:
            self.clock.end(token)

    @contextlib.contextmanager
    def replica_phase(self, name: str) -> Iterator[None]:
        """Inside a replica's job: switch its phase (e.g. "loss") and back; elsewhere nothing."""
        if name not in PHASES:
            raise ValueError(f"replica_phase: unknown phase {name!r}; use one of {', '.join(PHASES)}")
        scope = self.replica_scope()
        if scope is None:
            yield
            return
        scope.push(name)
        try:
            yield
        finally:
            scope.pop()

    @contextlib.contextmanager
    def replica(self, index: int, device: torch.device) -> Iterator[None]:
        """Entered in a replica's thread around its job: its allocations and time go to `device`."""
        key = device_key(device)
        self._note_device(key)
        scope = ReplicaScope(key, self.clock if self.timing else None)
        tracker = AllocationTracker(self.ledger, scope.where) if self.memory else None
        outer = self.replica_scope()
        with self.step_split.job(key) if self.step_split is not None else contextlib.nullcontext():
            self._thread.scope = scope
            if tracker is not None:
                tracker.__enter__()
            scope.start()
            try:
                yield
            finally:
                scope.close()
                self._thread.scope = outer
                if tracker is not None:
                    tracker.__exit__(None, None, None)

    def handing_off(self, devices: Sequence[torch.device]) -> contextlib.AbstractContextManager:
        """The calling thread hands jobs to the replica threads and waits for them (step_split.py)."""
        return self.step_split.handing_off(devices) if self.step_split is not None else contextlib.nullcontext()

    def peer_wait(self) -> contextlib.AbstractContextManager:
        """Inside a replica's job: a wait for the other replicas (step_split.py)."""
        return self.step_split.peer_wait() if self.step_split is not None else contextlib.nullcontext()

    def span(
        self, name: str, device: torch.device | str, start_seconds: float, seconds: float, hidden_seconds: float = 0.0
    ) -> None:
        """A phase that ran outside the calling thread's flow (e.g. DDP's bucket all-reduce)."""
        key = device_key(device)
        self._note_device(key)
        if self.timing:
            self.clock.add(key, name, start_seconds, seconds)
        if hidden_seconds:
            per_device = self.hidden_seconds.setdefault(key, {})
            per_device[name] = per_device.get(name, 0.0) + hidden_seconds

    def memory_level(self, device: torch.device | str, category: str, nbytes: int) -> None:
        """Bytes of `category` that `device` holds in storages resized in place (no allocation shows them)."""
        if category not in CATEGORIES:
            raise ValueError(f"category: unknown memory category {category!r}; use one of {', '.join(CATEGORIES)}")
        if self.memory:
            key = device_key(device)
            self._note_device(key)
            self.ledger.set_level(key, category, int(nbytes))

    # ---- what a step is made of ------------------------------------------------------------------
    def split(
        self, module: nn.Module, devices: Sequence[torch.device], output_device: torch.device, rows: Sequence[int]
    ) -> None:
        """A step's plan (one per forward): its devices, rows per device; the module lives on devices[0]."""
        with self._bookkeeping():
            if self.home is None:
                self.home = device_key(output_device)
            for device, count in zip(devices, rows):
                key = device_key(device)
                self._note_device(key)
                self.rows[key] = int(count)
            self.steps += 1
            self.watch(module, devices[0])

    def outputs(self, outputs: Sequence[Any], devices: Sequence[torch.device], stop: Sequence[Node | None]) -> None:
        """The replicas' outputs: their autograd nodes are their devices' backward."""
        if not self.backward_by_device:
            return
        with self._bookkeeping():
            for output, device in zip(outputs, devices):
                self.mark_backward(tree_leaves(output), device, stop)

    @contextlib.contextmanager
    def _bookkeeping(self) -> Iterator[None]:
        """The observer's own work on the calling thread: its own part of the step by thread ("observer")."""
        if self.step_split is None:
            yield
            return
        self.step_split.enter(OBSERVER)
        try:
            yield
        finally:
            self.step_split.leave(OBSERVER)

    def mark_backward(
        self, roots: Iterable[object], device: torch.device | str, stop: Iterable[Node | None] = ()
    ) -> None:
        """Charge and time the autograd nodes behind `roots` (a replica's outputs) to `device`."""
        self.backward.mark(roots, device_key(device), stop)

    # ---- pre-existing tensors --------------------------------------------------------------------
    def watch(self, module: nn.Module, device: torch.device | str | None = None) -> None:
        """Charge a module's parameters, buffers and gradients to `device` (default: home), and move a
        parameter's gradient to that device's books whenever autograd accumulates into it."""
        key = self.home_device() if device is None else device_key(device)
        self._note_device(key)
        if self.memory:
            for tensor in list(module.parameters()) + list(module.buffers()):
                self.ledger.charge(tensor, account_key(tensor, key), "parameters")
                if tensor.grad is not None:
                    self.ledger.charge(tensor.grad, account_key(tensor, key), "gradients")
        if id(module) in self._watched:
            return
        self._watched.add(id(module))
        if self.memory:

            def move_gradient(p: torch.Tensor) -> None:
                if p.grad is not None:
                    self.ledger.move(p.grad, account_key(p, key), "gradients")

            for param in module.parameters():
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(move_gradient))

    def watch_optimizer(self, optimizer: torch.optim.Optimizer, device: torch.device | str | None = None) -> None:
        """Charge an optimizer's existing state tensors as optimizer_state."""
        if not self.memory:
            return
        key = self.home_device() if device is None else device_key(device)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.ledger.charge(value, account_key(value, key), "optimizer_state")

    # ---- results ---------------------------------------------------------------------------------
    def report(self) -> Report:
        """Per-device peaks (over the whole observation), bytes by category at each peak, seconds by phase."""
        self.clock.resolve()
        accounts = self.ledger.accounts
        keys = list(self.devices) + sorted(k for k in accounts if k not in self.devices)
        devices = []
        for key in keys:
            account = accounts.get(key)
            by_category = dict(account.at_peak) if account else dict.fromkeys(CATEGORIES, 0)
            category_peaks = dict(account.category_peaks) if account else dict.fromkeys(CATEGORIES, 0)
            peak = self.allocator_peaks.fold_in(key, account.peak_bytes if account else 0, by_category)
            devices.append(
                DeviceReport(
                    key,
                    self.rows.get(key),
                    int(peak),
                    {c: int(by_category[c]) for c in CATEGORIES},
                    self.clock.seconds_by_phase(key),
                    {c: int(category_peaks[c]) for c in CATEGORIES},
                    dict(self.hidden_seconds.get(key, {})),
                )
            )
        return Report(
            devices=devices,
            steps=self.steps,
            spans=self.clock.spans() if self.trace else [],
            clock_origin_unix_seconds=self.clock.origin_unix_seconds,
            threads=self.step_split.summary(self.steps, self.memory) if self.step_split is not None else None,
        )
