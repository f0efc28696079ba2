"""`Observer`: per-device memory by category and time by phase, around any step.

    with dpkit.observe.Observer() as obs:
        loss = dp(x, target=y)
        with obs.phase("backward"):
            loss.backward()
        optimizer.step()
    print(obs.report().format_table())

How work is attributed to devices on virtual CPU devices (all tensors report plain `cpu`):
- a replica's thread charges what it allocates to its own device (forward -> activations, a loss
  computed inside the replica -> loss);
- the calling thread charges to the phase's device (replicate -> parameters of that replica, gather ->
  gathered_outputs on the output device, optimizer step -> optimizer_state), else to the home device;
- autograd runs CPU backward in the calling thread, so dpkit marks every autograd node a replica's
  forward created with that replica's device; work inside such a node is charged (as gradients) and
  timed for that device. Everything else in backward (the loss on gathered outputs, gather's backward,
  accumulation into the original parameters, i.e. the reduction) is charged to the home device, where
  it lives on GPUs too. A replica's parameter gradient that becomes the reduced `.grad` moves to the
  home device's books when it is accumulated. Gradient buffers autograd sums between two nodes are
  charged to the home device: the approximation is small.
On CUDA the device is the tensor's own, the peak is the allocator's, and phases are timed with events.
Nothing here runs unless an Observer is started: DataParallel checks `active()` and skips it all.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from dpkit.observe.memory import CATEGORIES, AllocationTracker, MemoryLedger, device_key, fresh_tensors
from dpkit.observe.report import DeviceReport, Report
from dpkit.observe.timing import PHASES, PhaseClock

PHASE_CATEGORY = {
    "scatter": "other",
    "replicate": "parameters",
    "forward": "activations",
    "gather": "gathered_outputs",
    "loss": "loss",
    "backward": "gradients",
    "reduce": "gradients",
    "optimizer": "optimizer_state",
}

_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"

_active: list["Observer"] = []
_main_mode: "_CallingThreadTracker | None" = None  # one dispatch mode for every observer in the calling thread
_replica_local = threading.local()  # .scopes: the observers' scopes entered in this replica thread


def active() -> tuple["Observer", ...]:
    """The started observers; empty (and cheap to ask) when nothing is being measured."""
    return tuple(_active)


class _CallingThreadTracker(TorchDispatchMode):
    """The calling thread's dispatch mode, shared by all started observers so they can start and stop
    in any order (a dispatch mode can only leave the top of torch's mode stack)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(_replica_local, "scopes", None):  # a replica running in this thread charges its own work
            return out
        for tensor in fresh_tensors(func, out):
            for observer in _active:
                if observer.memory:
                    device, category = observer._main_where()
                    observer.ledger.charge(tensor, device if tensor.device.type == "cpu" else device_key(tensor.device), category)
        return out


class _ReplicaScope:
    """One observer's state in one replica thread: its device and the phase it is in."""

    def __init__(self, observer: "Observer", device: str):
        self.observer = observer
        self.device = device
        self.phase = "forward"
        self.open = None

    def where(self) -> tuple[str, str]:
        return self.device, PHASE_CATEGORY[self.phase]

    def switch(self, phase: str) -> str:
        previous = self.phase
        if self.open is not None:
            self.observer.clock.end(self.open)
        self.phase = phase
        self.open = self.observer.clock.begin(self.device, phase) if self.observer.timing else None
        return previous


class Observer:
    """Measure memory by category and time by phase, per device, while started.

    Args:
        device: the home device, where the calling thread's work is charged (default: the output
            device of the first DataParallel call, else cpu:0).
        memory: keep per-device memory accounts (a dispatch mode in every observed thread).
        timing: time phases (host timers on CPU, CUDA events on GPU).
        trace: keep the spans for `Report.save_trace`.
        models, optimizers: charge their existing parameters, gradients and state from the start.
    """

    def __init__(self, device: torch.device | str | None = None, *, memory: bool = True, timing: bool = True,
                 trace: bool = True, models: Iterable[nn.Module] = (), optimizers: Iterable[torch.optim.Optimizer] = ()):
        self.home = None if device is None else device_key(device)
        self.memory = memory
        self.timing = timing
        self.trace = trace
        self._initial_models = list(models)
        self._initial_optimizers = list(optimizers)
        self._started = False

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Observer":
        if self._started:
            raise RuntimeError("Observer.start: already started; use a new Observer per measurement")
        self._started = True
        self._node_local = threading.local()  # .stack: this observer's marked nodes running in a thread
        self.ledger = MemoryLedger()
        self.clock = PhaseClock(keep_spans=self.trace)
        self.devices: list[str] = []  # in the order DataParallel or watch() named them
        self.rows: dict[str, int] = {}
        self.steps = 0
        self._phases: list[tuple[str, str, Any]] = []
        self._handles: list[Any] = []
        self._watched: set[int] = set()
        self._accumulate_nodes: dict[int, Any] = {}  # strong refs: hooks once per node, ids stay unique
        self._node_seconds_off_home = 0.0
        self.optimizers_seen: weakref.WeakSet = weakref.WeakSet()
        # the allocator's peak is process-wide: only an observer started when no other runs may reset
        # and report it (a nested one, e.g. balance's calibration, keeps to its own books)
        self._owns_cuda_peak = torch.cuda.is_available() and not _active
        if self._owns_cuda_peak:
            for index in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(index)
        global _main_mode
        if _main_mode is None:
            _main_mode = _CallingThreadTracker()
            _main_mode.__enter__()
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
        self._handles.append(register_optimizer_step_post_hook(self._optimizer_post))
        _active.append(self)
        for model in self._initial_models:
            self.watch(model)
        for optimizer in self._initial_optimizers:
            self.watch_optimizer(optimizer)
        return self

    def stop(self) -> None:
        if not self._started or self not in _active:
            return
        _active.remove(self)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._accumulate_nodes.clear()
        global _main_mode
        if not _active and _main_mode is not None:
            mode, _main_mode = _main_mode, None
            if _get_current_dispatch_mode() is not mode:
                raise RuntimeError("Observer.stop: another dispatch mode was entered after the observer started and is "
                                   "still active; exit it before stopping the observer")
            mode.__exit__(None, None, None)
        self.clock.resolve()

    def __enter__(self) -> "Observer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- where the calling thread's work goes ----------------------------------------------------
    def home_device(self) -> str:
        if self.home is None:
            self.home = self.devices[0] if self.devices else "cpu:0"
        return self.home

    def _main_where(self) -> tuple[str, str]:
        stack = getattr(self._node_local, "stack", None)
        if stack:
            return stack[-1][0], "gradients"
        if torch._C._current_graph_task_id() != -1:  # in backward, outside any marked node
            return self.home_device(), "gradients"
        if self._phases:
            name, device, _ = self._phases[-1]
            return device, PHASE_CATEGORY[name]
        return self.home_device(), "other"

    def note_devices(self, devices: Sequence[torch.device], output_device: torch.device, rows: Sequence[int]) -> None:
        """Called by DataParallel on every call: its devices, output device and rows per device."""
        if self.home is None:
            self.home = device_key(output_device)
        for device, count in zip(devices, rows):
            key = device_key(device)
            if key not in self.devices:
                self.devices.append(key)
            self.rows[key] = int(count)
        self.steps += 1

    # ---- phases ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str, device: torch.device | str | None = None) -> Iterator[None]:
        """Time `name` on `device` (default: home) and charge the calling thread's allocations to it."""
        if name not in PHASES:
            raise ValueError(f"phase: unknown phase {name!r}; use one of {', '.join(PHASES)}")
        key = self.home_device() if device is None else device_key(device)
        token = self.clock.begin(key, name) if self.timing else None
        off_home_before = self._node_seconds_off_home
        self._phases.append((name, key, token))
        try:
            yield
        finally:
            self._phases.pop()
            if token is not None:
                if name == "backward" and token.start_event is None:
                    # other devices' backward nodes were timed on their own: the rest is this device's
                    wall = time.perf_counter() - token.host_start
                    self.clock.add(key, name, token.host_start, max(0.0, wall - (self._node_seconds_off_home - off_home_before)))
                else:
                    self.clock.end(token)

    def _in_phase(self, name: str) -> bool:
        return any(phase == name for phase, _, _ in self._phases)

    # ---- replica threads -------------------------------------------------------------------------
    @contextlib.contextmanager
    def replica(self, index: int, device: torch.device) -> Iterator[None]:
        """Entered in a replica's worker thread: its allocations and time go to `device`."""
        scope = _ReplicaScope(self, device_key(device))
        tracker = AllocationTracker(self.ledger, scope.where) if self.memory else None
        scopes = getattr(_replica_local, "scopes", None)
        if scopes is None:
            scopes = _replica_local.scopes = []
        if tracker is not None:
            tracker.__enter__()
        scopes.append(scope)
        scope.switch("forward")
        try:
            yield
        finally:
            if scope.open is not None:
                self.clock.end(scope.open)
            scopes.remove(scope)
            if tracker is not None:
                tracker.__exit__(None, None, None)

    # ---- backward attribution --------------------------------------------------------------------
    def mark_backward(self, roots: Iterable[Any], device: torch.device, stop: Iterable[Any] = ()) -> None:
        """Charge and time the autograd nodes behind `roots` (a replica's outputs) to `device`.

        The walk stops at the nodes in `stop` (the graph the replica's inputs came from) and at the
        original parameters' AccumulateGrad nodes, which are the reduction onto the home device.
        """
        key = device_key(device)
        stop_ids = {id(node) for node in stop if node is not None}
        stack = [root.grad_fn for root in roots if isinstance(root, torch.Tensor) and root.grad_fn is not None]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen or id(node) in stop_ids:
                continue
            seen.add(id(node))
            if node.name() == _ACCUMULATE_GRAD:
                if id(node) not in self._accumulate_nodes:
                    self._accumulate_nodes[id(node)] = node
                    self._hook_node(node, self.home_device(), "reduce")
                continue
            self._hook_node(node, key, "backward")
            stack.extend(next_node for next_node, _ in node.next_functions)

    def _hook_node(self, node: Any, device: str, phase: str) -> None:
        def enter(*_: Any) -> None:
            stack = getattr(self._node_local, "stack", None)
            if stack is None:
                stack = self._node_local.stack = []
            stack.append((device, phase, self.clock.begin(device, phase) if self.timing else None))

        def leave(*_: Any) -> None:
            stack = getattr(self._node_local, "stack", None)
            if not stack:
                return
            _, _, token = stack.pop()
            if token is not None:
                if token.start_event is None and (device != self.home_device() or phase != "backward"):
                    self._node_seconds_off_home += time.perf_counter() - token.host_start
                self.clock.end(token)

        handles = (node.register_prehook(enter), node.register_hook(leave))
        if phase == "reduce":  # AccumulateGrad nodes outlive the step; the rest die with their graph
            self._handles.extend(handles)

    # ---- pre-existing tensors --------------------------------------------------------------------
    def watch(self, module: nn.Module, device: torch.device | str | None = None) -> None:
        """Charge a module's parameters, buffers and gradients to `device` (default: home), and move a
        parameter's gradient to that device's books whenever autograd accumulates into it."""
        key = self.home_device() if device is None else device_key(device)
        if key not in self.devices:
            self.devices.append(key)
        if self.memory:
            for tensor in list(module.parameters()) + list(module.buffers()):
                self.ledger.charge(tensor, key if tensor.device.type == "cpu" else device_key(tensor.device), "parameters")
                if tensor.grad is not None:
                    self.ledger.charge(tensor.grad, key if tensor.device.type == "cpu" else device_key(tensor.device), "gradients")
        if id(module) in self._watched:
            return
        self._watched.add(id(module))
        if self.memory:
            for param in module.parameters():
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(
                        lambda p, key=key: p.grad is not None and self.ledger.move(
                            p.grad, key if p.device.type == "cpu" else device_key(p.device), "gradients")))

    def watch_optimizer(self, optimizer: torch.optim.Optimizer, device: torch.device | str | None = None) -> None:
        """Charge an optimizer's existing state tensors as optimizer_state."""
        if not self.memory:
            return
        key = self.home_device() if device is None else device_key(device)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.ledger.charge(value, key if value.device.type == "cpu" else device_key(value.device), "optimizer_state")

    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.optimizers_seen.add(optimizer)
        self.watch_optimizer(optimizer)
        if self._in_phase("optimizer"):
            self._phases.append(("optimizer", self.home_device(), None))  # nested in the caller's phase
            return
        self._phases.append(("optimizer", self.home_device(), self.clock.begin(self.home_device(), "optimizer") if self.timing else None))

    def _optimizer_post(self, *_: Any) -> None:
        if self._phases and self._phases[-1][0] == "optimizer":
            _, _, token = self._phases.pop()
            if token is not None:
                self.clock.end(token)

    # ---- results ---------------------------------------------------------------------------------
    def report(self) -> Report:
        """Per-device peaks (over the whole observation), bytes by category at each peak, seconds by phase."""
        self.clock.resolve()
        accounts = self.ledger.accounts
        keys = list(self.devices) + sorted(k for k in accounts if k not in self.devices)
        devices = []
        for key in keys:
            account = accounts.get(key)
            peak = account.peak_bytes if account else 0
            by_category = dict(account.at_peak) if account else dict.fromkeys(CATEGORIES, 0)
            category_peaks = dict(account.category_peaks) if account else dict.fromkeys(CATEGORIES, 0)
            if key.startswith("cuda") and self._owns_cuda_peak:
                # the allocator's peak is the truth; what dpkit did not see is "other"
                allocator_peak = torch.cuda.max_memory_allocated(int(key.split(":")[1]))
                if allocator_peak > peak:
                    by_category["other"] += allocator_peak - peak
                    peak = allocator_peak
            devices.append(DeviceReport(key, self.rows.get(key), int(peak), {c: int(by_category[c]) for c in CATEGORIES},
                                        self.clock.seconds_by_phase(key), {c: int(category_peaks[c]) for c in CATEGORIES}))
        return Report(devices=devices, steps=self.steps, spans=self.clock.spans() if self.trace else [])


def replica_wrap(observers: Sequence[Observer]):
    """The `wrap` hook for parallel_apply: every observer's replica scope, entered in the worker thread
    (None when nothing observes, so replicas run exactly as without dpkit.observe)."""
    if not observers:
        return None

    @contextlib.contextmanager
    def wrap(index: int, device: torch.device) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for observer in observers:
                stack.enter_context(observer.replica(index, device))
            yield

    return wrap


@contextlib.contextmanager
def replica_phase(name: str) -> Iterator[None]:
    """Inside a replica thread: switch every observer's scope to `name` (e.g. "loss") and back."""
    scopes = getattr(_replica_local, "scopes", None)
    if not scopes:
        yield
        return
    previous = [scope.switch(name) for scope in scopes]
    try:
        yield
    finally:
        for scope, phase in zip(scopes, previous):
            scope.switch(phase)


def phases(observers: Sequence[Observer], name: str, device: torch.device | None = None) -> contextlib.AbstractContextManager:
    """`Observer.phase` for several observers at once (DataParallel's calls); a no-op when empty."""
    if not observers:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for observer in observers:
        stack.enter_context(observer.phase(name, device))
    return stack
