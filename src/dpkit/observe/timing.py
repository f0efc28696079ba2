"""Per-device phase times and the spans behind a Chrome trace.

On CPU a span is two host timestamps. On CUDA it is a pair of events recorded on the device's current
stream, resolved when the report is built, so asynchronous kernels are timed where they run rather
than where they were launched.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

# in pipeline order; "reduce" is DataParallel's gradient sum onto device 0, "all_reduce" the exchange among
# replicas or processes (replicated, ddp)
PHASES = (
    "scatter",
    "replicate",
    "forward",
    "gather",
    "loss",
    "backward",
    "reduce",
    "all_reduce",
    "all_gather",  # a sharded strategy gathering a unit's parameters (inside forward or backward)
    "reduce_scatter",  # and reducing a unit's gradients to each process's shard (inside backward)
    "optimizer",
    "average",  # localsgd and diloco: the replicas' meeting every few steps (after the optimizer's step)
)

# consecutive spans of one device and phase closer than this are drawn as one (backward runs node by node)
_MERGE_GAP_SECONDS = 50e-6


def _stream_of(device: str) -> torch.cuda.Stream:
    """The current stream of the device the span belongs to (not of the calling thread's device)."""
    return torch.cuda.current_stream(torch.device(device))


@dataclass
class Span:
    device: str
    phase: str
    start_seconds: float  # host time since the clock's origin
    seconds: float


@dataclass
class _Open:
    device: str
    phase: str
    host_start: float
    start_event: torch.cuda.Event | None = None


class PhaseClock:
    """Accumulates seconds per (device, phase) and keeps the spans for the trace."""

    def __init__(self, keep_spans: bool = True):
        self.origin = time.perf_counter()
        self.origin_unix_seconds = time.time()  # lines up the clocks of several processes in one trace
        self.keep_spans = keep_spans
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._pending_cuda: list[tuple[_Open, torch.cuda.Event, torch.cuda.Event]] = []  # (phase, start, end)
        self._totals: dict[str, dict[str, float]] = {}

    def begin(self, device: str, phase: str) -> _Open:
        token = _Open(device, phase, time.perf_counter())
        if device.startswith("cuda"):
            token.start_event = torch.cuda.Event(enable_timing=True)
            token.start_event.record(_stream_of(device))
        return token

    def end(self, token: _Open) -> None:
        if token.start_event is not None:
            end_event = torch.cuda.Event(enable_timing=True)
            end_event.record(_stream_of(token.device))
            with self._lock:
                self._pending_cuda.append((token, token.start_event, end_event))
            return
        self.add(token.device, token.phase, token.host_start, time.perf_counter() - token.host_start)

    def add(self, device: str, phase: str, host_start: float, seconds: float) -> None:
        with self._lock:
            start = host_start - self.origin
            last = self._spans[-1] if self._spans else None
            if (
                last is not None
                and last.device == device
                and last.phase == phase
                and last.start_seconds <= start < last.start_seconds + last.seconds + _MERGE_GAP_SECONDS
            ):
                last.seconds = max(last.start_seconds + last.seconds, start + seconds) - last.start_seconds
            elif self.keep_spans:
                self._spans.append(Span(device, phase, start, seconds))
            per_device = self._totals.setdefault(device, {})
            per_device[phase] = per_device.get(phase, 0.0) + seconds

    def resolve(self) -> None:
        """Turn recorded CUDA event pairs into seconds (waits for them to complete)."""
        with self._lock:
            pending, self._pending_cuda = self._pending_cuda, []
        for token, start_event, end_event in pending:
            end_event.synchronize()
            self.add(token.device, token.phase, token.host_start, start_event.elapsed_time(end_event) / 1e3)

    def seconds_by_phase(self, device: str) -> dict[str, float]:
        self.resolve()
        with self._lock:
            recorded = dict(self._totals.get(device, {}))
        return {phase: recorded[phase] for phase in PHASES if phase in recorded}

    def spans(self) -> list[Span]:
        self.resolve()
        with self._lock:
            return sorted(self._spans, key=lambda s: s.start_seconds)
