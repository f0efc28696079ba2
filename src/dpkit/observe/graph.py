"""Backward attribution: the autograd nodes a replica's forward created belong to that replica's device.

On CPU autograd runs every node in the thread that called backward, so dpkit marks the nodes behind each
replica's outputs with the replica's device; a marked node's work is charged (as gradients) and timed on
that device. The original parameters' AccumulateGrad nodes are the reduction onto the home device, and so
is the one node of a step that sums the replicas' gradients before them (DataParallel's broadcast on virtual
CPU devices, parallel/replica_cache.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from dpkit.observe.timing import PhaseClock

_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
_BROADCAST = "BroadcastParametersBackward"  # one per step, reached from every replica's outputs


class BackwardMarker:
    """Hooks autograd nodes so that the thread running them knows whose work it is doing."""

    def __init__(self, clock: PhaseClock | None, home_device: Callable[[], str]):
        self.clock = clock
        self.home_device = home_device
        self._local = threading.local()  # .stack: marked nodes running in this thread
        self._accumulate_nodes: dict[int, Node] = {}  # strong refs: hooked once per node, ids stay unique
        self._broadcast: Node | None = None  # the last broadcast node hooked (a strong ref: its id stays unique)
        self._handles: list[RemovableHandle] = []
        self.seconds_off_home = 0.0  # time spent in nodes of other devices (taken out of the home's backward)

    def current(self) -> tuple[str, str] | None:
        """(device, phase) of the marked node running in this thread, if any."""
        stack = getattr(self._local, "stack", None)
        return stack[-1][:2] if stack else None

    def mark(self, roots: Iterable[object], device: str, stop: Iterable[Node | None] = ()) -> None:
        """Mark the nodes behind `roots` with `device`, stopping at the nodes in `stop` (the graph the
        replica's inputs came from) and at the reduction's nodes (hooked once as the home's "reduce")."""
        stop_ids = {id(node) for node in stop if node is not None}
        stack: list[Node | None] = [
            root.grad_fn for root in roots if isinstance(root, torch.Tensor) and root.grad_fn is not None
        ]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen or id(node) in stop_ids:
                continue
            seen.add(id(node))
            name = node.name()
            if name == _ACCUMULATE_GRAD:
                if id(node) not in self._accumulate_nodes:
                    self._accumulate_nodes[id(node)] = node
                    self._hook(node, self.home_device(), "reduce")
                continue
            if name == _BROADCAST:
                if node is not self._broadcast:
                    self._broadcast = node
                    self._hook(node, self.home_device(), "reduce", keep=False)
                continue
            self._hook(node, device, "backward")
            stack.extend(next_node for next_node, _ in node.next_functions)

    def _hook(self, node: Node, device: str, phase: str, keep: bool | None = None) -> None:
        def enter(*_: object) -> None:
            stack = getattr(self._local, "stack", None)
            if stack is None:
                stack = self._local.stack = []
            stack.append((device, phase, self.clock.begin(device, phase) if self.clock is not None else None))

        def leave(*_: object) -> None:
            stack = getattr(self._local, "stack", None)
            if not stack:
                return
            _, _, token = stack.pop()
            if token is not None and self.clock is not None:  # (a token comes from the clock)
                if token.start_event is None and (device != self.home_device() or phase != "backward"):
                    self.seconds_off_home += time.perf_counter() - token.host_start
                self.clock.end(token)

        handles = (node.register_prehook(enter), node.register_hook(leave))
        if phase == "reduce" if keep is None else keep:  # AccumulateGrad nodes outlive the step; the others die
            self._handles.extend(handles)  # with their graph

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._accumulate_nodes.clear()
        self._broadcast = None
