"""What an Observer measured, per device: a table, JSON, a stacked bar chart and a Chrome trace (the phases, and
the collectives each rank issued, on each device's track)."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpkit.observe.memory import CATEGORIES
from dpkit.observe.step_split import REPLICAS
from dpkit.observe.timing import PHASES, Span

if TYPE_CHECKING:
    from dpkit.observe.collectives import Collective

SCHEMA_VERSION = 1


def write_json(data: Any, path: str | os.PathLike[str]) -> Path:
    """`data` as indented JSON at `path`, creating its folder (reports of profile, bench and plan)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


# the calling thread's phases that exist only because the batch is split among replicas
SPLITTING = ("scatter", "replicate", "gather")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def thread_lines(threads: dict[str, Any] | None) -> list[str]:
    """The step by thread under the table: the calling thread's own work and its waits, then what each
    replica thread did while it waited, and what of the step is the parallelism's rather than the model's."""
    if not threads or not threads["steps"]:
        return []
    caller = threads["calling_thread"]
    phases = ", ".join(f"{name} {_ms(s)}" for name, s in caller["own_seconds_by_phase"].items() if s >= 5e-6)
    lines = [
        f"step {_ms(threads['step_seconds'])} ms by thread (ms per step): calling thread {_ms(caller['own_seconds'])} "
        f"of its own ({phases}; off the CPU {_ms(caller['descheduled_seconds'] + caller['blocked_seconds'])}) "
        f"+ {_ms(caller['waiting_seconds'])} waiting for the replica threads in {caller['hand_offs']:.3g} hand-offs"
    ]
    replicas = threads["replica_threads"]
    if replicas:
        names = {"running": "running", "gil": "GIL", "descheduled": "descheduled", "peers": "other replicas"}
        names["hand_off"] = "hand-off"
        lines.append(
            "  while it waits: "
            + "; ".join(
                f"{r['device']} " + ", ".join(f"{label} {_ms(r[part + '_seconds'])}" for part, label in names.items())
                for r in replicas
            )
        )
        own = caller["own_seconds_by_phase"]
        mean = {part: sum(r[part + "_seconds"] for r in replicas) / len(replicas) for part in names}
        splitting = sum(own.get(p, 0.0) for p in SPLITTING)
        lines.append(
            f"  the parallelism's own share: scatter + replicate + gather {_ms(splitting)} "
            f"on the calling thread; in a replica thread (mean) hand-offs {_ms(mean['hand_off'])}, "
            f"GIL {_ms(mean['gil'])}, waiting for other replicas {_ms(mean['peers'])}"
        )
    in_turns = caller["own_seconds_by_phase"].get(REPLICAS, 0.0)
    if in_turns >= 5e-6:
        said = f"  replica jobs that ran in turns on the calling thread: {REPLICAS} {_ms(in_turns)} (no hand-off)"
        if not replicas:
            splitting = sum(caller["own_seconds_by_phase"].get(p, 0.0) for p in SPLITTING)
            said += f"; the parallelism's own share: scatter + replicate + gather {_ms(splitting)}"
        lines.append(said)
    if threads["memory_accounting"]:
        lines.append("  (memory accounting was on: its dispatch modes add Python work to every operator)")
    return lines


def aligned_columns(rows: list[list[str]]) -> list[str]:
    """Right-aligned columns, two spaces apart; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]


@dataclass
class DeviceReport:
    device: str
    rows: int | None  # rows of the last observed step on this device (None: not a DataParallel device)
    peak_bytes: int
    bytes_by_category: dict[str, int]  # live bytes at the moment of the peak; sums to peak_bytes
    seconds_by_phase: dict[str, float]
    peak_bytes_by_category: dict[str, int] = field(default_factory=dict)  # each category's own peak
    hidden_seconds_by_phase: dict[str, float] = field(
        default_factory=dict
    )  # overlapped with other work (ddp's all-reduce behind backward)


@dataclass
class CollectiveSpan:
    """A collective a device's rank issued (observe/collectives.py's record), on the spans' time axis: issued at
    `start_seconds`; `seconds` the time the call took to return on the issuing thread, or for one issued
    asynchronously (`async_op`, DDP's gradient buckets, which return when enqueued) the time until its work
    completed, where the issuer learned it; None when that is not known."""

    device: str
    op: str  # as recorded: torch.distributed's function (all_gather_single) or dpkit's words for it
    start_seconds: float
    seconds: float | None
    sequence: int
    size_bytes: int
    step: int
    site: str
    async_op: bool = False

    @property
    def name(self) -> str:
        """The collective's function: `all_reduce` for `all_reduce of gradient bucket 0`, `barrier` for
        `barrier (engine.close)`."""
        return self.op.split(" ", 1)[0]

    @property
    def kind(self) -> str:
        """The op without a bucket's number: what the per-step count groups by."""
        return self.op.rstrip("0123456789 ")


def collective_spans(entries: Iterable[Collective], device: str, origin: float) -> list[CollectiveSpan]:
    """Record entries as spans of `device` on a clock whose zero is `origin` (time.perf_counter(), as the phase
    clock's: `Observer.clock.origin`)."""
    return [
        CollectiveSpan(
            device,
            e.op,
            e.issued - origin,
            (None if e.completed is None else e.completed - e.issued) if e.async_op else e.seconds,
            e.sequence,
            e.size_bytes,
            e.step,
            e.site,
            e.async_op,
        )
        for e in entries
    ]


@dataclass
class Report:
    devices: list[DeviceReport]
    steps: int = 0
    spans: list[Span] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    clock_origin_unix_seconds: float = 0.0  # wall-clock time of the spans' zero, to line up processes
    # the step by thread, seconds per step (observe/step_split.py); None when time was not measured
    threads: dict[str, Any] | None = None
    # the collectives each process issued in the observed steps (dpkit profile under ddp and fsdp), in its order
    collectives: list[CollectiveSpan] = field(default_factory=list)

    @classmethod
    def merged(cls, reports: list[Report]) -> Report:
        """One report from several processes' (ddp: one per rank, in rank order): every device, spans on
        one time axis, the steps of the first."""
        if not reports:
            return cls(devices=[])
        origin = min(r.clock_origin_unix_seconds for r in reports)
        devices = [device for r in reports for device in r.devices]
        spans = sorted(
            (
                Span(s.device, s.phase, s.start_seconds + r.clock_origin_unix_seconds - origin, s.seconds)
                for r in reports
                for s in r.spans
            ),
            key=lambda s: s.start_seconds,
        )
        collectives = [
            replace(c, start_seconds=c.start_seconds + r.clock_origin_unix_seconds - origin)
            for r in reports
            for c in r.collectives
        ]
        return cls(
            devices=devices,
            steps=reports[0].steps,
            spans=spans,
            meta=dict(reports[0].meta),
            clock_origin_unix_seconds=origin,
            threads=reports[0].threads,  # each process has its own threads: the first's (rank 0)
            collectives=collectives,
        )

    @property
    def imbalance(self) -> float:
        """Max over mean of the per-device peaks (1.0 = perfectly even; 0.0 when nothing was measured)."""
        peaks = [d.peak_bytes for d in self.devices]
        mean = sum(peaks) / len(peaks) if peaks else 0.0
        return max(peaks) / mean if mean > 0 else 0.0

    def device(self, name: str) -> DeviceReport:
        for entry in self.devices:
            if entry.device == name:
                return entry
        raise KeyError(f"device {name!r} is not in the report; it has {', '.join(d.device for d in self.devices)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            **self.meta,
            "steps": self.steps,
            "imbalance": self.imbalance,
            "devices": [
                {
                    "device": d.device,
                    "rows": d.rows,
                    "peak_bytes": d.peak_bytes,
                    "bytes_by_category": dict(d.bytes_by_category),
                    "peak_bytes_by_category": dict(d.peak_bytes_by_category),
                    "seconds_by_phase": dict(d.seconds_by_phase),
                    "hidden_seconds_by_phase": dict(d.hidden_seconds_by_phase),
                }
                for d in self.devices
            ],
            **({"threads": self.threads} if self.threads is not None else {}),
            **({"collectives_per_step": self.collectives_per_step()} if self.collectives else {}),
        }

    def collectives_per_step(self) -> dict[str, dict[str, float]]:
        """Per device, the collectives its rank issued per observed step, by kind (`all_reduce of gradient
        bucket`, `all_gather_single`, ...), most first."""
        steps = max(self.steps, 1)
        counts: dict[str, Counter[str]] = {}
        for collective in self.collectives:
            counts.setdefault(collective.device, Counter())[collective.kind] += 1
        return {device: {kind: n / steps for kind, n in kinds.most_common()} for device, kinds in counts.items()}

    def collectives_line(self) -> str | None:
        """How many collectives each rank issued per step, and of which kinds: one line, None without any."""
        per_device = self.collectives_per_step()
        if not per_device:
            return None

        def said(kinds: dict[str, float]) -> str:
            parts = ", ".join(f"{n:.3g} {kind}" for kind, n in kinds.items())
            return f"{sum(kinds.values()):.3g} ({parts})"

        if len({said(kinds) for kinds in per_device.values()}) == 1:
            return f"collectives issued per step, on each rank: {said(next(iter(per_device.values())))}"
        return "collectives issued per step: " + "; ".join(f"{d} {said(k)}" for d, k in per_device.items())

    def save_json(self, path: str | Path) -> Path:
        return write_json(self.to_dict(), path)

    def format_table(self) -> str:
        """Two tables, one row per device: memory (rows of the last step, the peak and its breakdown, MiB) and time
        by phase (ms per step: the mean over the observed steps, the unit of the step-by-thread lines below)."""
        mib = 1024 * 1024
        per_step = 1.0 / max(self.steps, 1)
        used_phases = [p for p in PHASES if any(p in d.seconds_by_phase for d in self.devices)]
        hidden_phases = [p for p in PHASES if any(d.hidden_seconds_by_phase.get(p) for d in self.devices)]
        short = {
            "parameters": "params",
            "gradients": "grads",
            "optimizer_state": "optim",
            "gathered_parameters": "unsharded",
            "activations": "activ",
            "gathered_outputs": "gathered",
            "loss": "loss",
            "other": "other",
        }
        memory = [["device", "rows", "peak MiB"] + [short[c] for c in CATEGORIES]]
        time = [["device"] + [f"{p} ms" for p in used_phases] + [f"{p} hidden ms" for p in hidden_phases]]
        for d in self.devices:
            row = [d.device, "-" if d.rows is None else str(d.rows), f"{d.peak_bytes / mib:.2f}"]
            memory.append(row + [f"{d.bytes_by_category.get(c, 0) / mib:.2f}" for c in CATEGORIES])
            time.append(
                [d.device]
                + [f"{d.seconds_by_phase.get(p, 0.0) * per_step * 1e3:.2f}" for p in used_phases]
                + [f"{d.hidden_seconds_by_phase.get(p, 0.0) * per_step * 1e3:.2f}" for p in hidden_phases]
            )
        out = aligned_columns(memory)
        out.append(f"imbalance (max/mean of per-device peaks): {self.imbalance:.3f}   steps observed: {self.steps}")
        if self.meta.get("balance_note"):  # why a memory balance left the peaks uneven, and the batch that evens them
            out.append(str(self.meta["balance_note"]))
        if used_phases:
            out.append(f"time by phase, ms per step (the mean of the {self.steps} observed step(s)):")
            out += aligned_columns(time)
        out += thread_lines(self.threads)
        line = self.collectives_line()
        if line:
            out.append(line)
        return "\n".join(out)

    def save_png(self, path: str | Path, title: str | None = None) -> Path:
        """A stacked bar per device: bytes by category at that device's peak."""
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        names = [d.device for d in self.devices]
        figure, axes = plt.subplots(figsize=(max(5.0, 1.2 * len(names) + 4.0), 4.0))
        bottoms = [0.0] * len(names)
        for category in CATEGORIES:
            heights = [d.bytes_by_category.get(category, 0) / 2**20 for d in self.devices]
            if any(heights):
                axes.bar(names, heights, bottom=bottoms, label=category)
                bottoms = [b + h for b, h in zip(bottoms, heights)]
        axes.set_ylabel("MiB at the device's peak")
        axes.set_title(title or f"memory by category (imbalance {self.imbalance:.2f})")
        axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not over them
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
        return path

    def trace_events(self) -> list[dict[str, Any]]:
        """Chrome trace events: one track (thread) per device, one complete event per phase span, and on the same
        track each collective its rank issued, named by its function (`all_reduce`, `all_gather_single`): a
        complete event lasting until the call returned, or an instant one where it was issued asynchronously; its
        args give the op as recorded, its sequence, bytes, step and the call site."""
        track = {name: i + 1 for i, name in enumerate(d.device for d in self.devices)}
        for span in self.spans:
            track.setdefault(span.device, len(track) + 1)
        for collective in self.collectives:
            track.setdefault(collective.device, len(track) + 1)
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "dpkit"}}
        ]
        for name, tid in track.items():
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}})
        for span in self.spans:
            events.append(
                {
                    "name": span.phase,
                    "cat": "phase",
                    "ph": "X",
                    "pid": 1,
                    "tid": track[span.device],
                    "ts": round(span.start_seconds * 1e6, 3),
                    "dur": round(span.seconds * 1e6, 3),
                }
            )
        for collective in self.collectives:
            event: dict[str, Any] = {
                "name": collective.name,
                "cat": "collective",
                "pid": 1,
                "tid": track[collective.device],
                "ts": round(collective.start_seconds * 1e6, 3),
                "args": {
                    "op": collective.op,
                    "sequence": collective.sequence,
                    "bytes": collective.size_bytes,
                    "step": collective.step,
                    "site": collective.site,
                },
            }
            if collective.async_op:
                event["args"]["async"] = True
            if collective.seconds is None:
                event.update(ph="i", s="t")
            else:
                event.update(ph="X", dur=round(collective.seconds * 1e6, 3))
            events.append(event)
        return events

    def save_trace(self, path: str | Path) -> Path:
        """Write a Chrome trace JSON (open it in https://ui.perfetto.dev or chrome://tracing)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": self.trace_events(), "displayTimeUnit": "ms"}))
        return path
