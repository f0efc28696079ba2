"""Several strategies profiled on the same model, data and devices, one after another, and shown side by side
(`dpkit profile --strategies dp,ddp`).

    reports = profile_strategies(ProfileSpec(example="digits", accelerator="cpu", devices=2), ["dp", "ddp"])

A strategy with a process per device runs in processes of its own, started here through dpkit's launcher, each
running this module's worker (`python -m dpkit.tools.profile_strategies SPEC OUT`); their rank 0 hands its
report back in a file, so that this process holds every strategy's report. `run_strategies` also prints the
side-by-side table and writes the files asked for: the JSON's "runs" hold one report per strategy in the order
given, the PNG shows them all, and each strategy's trace goes to a file of its own (trace-dp.json, ...).
"""

from __future__ import annotations

import pickle
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from dpkit.launch import Command, launched, relaunch
from dpkit.observe import Report
from dpkit.observe.report import SCHEMA_VERSION, write_json
from dpkit.observe.side_by_side import save_side_by_side_png, side_by_side_table
from dpkit.strategies import strategy_class
from dpkit.tools.profile import ProfileSpec, checked_devices, compile_line, profile, sharding_line

WORKER = "dpkit.tools.profile_strategies"


def strategy_specs(spec: ProfileSpec, strategies: Sequence[str]) -> list[ProfileSpec]:
    """`spec` once per strategy, every one checked (settings, devices, the batch's split) before any runs."""
    if not strategies:
        raise ValueError("strategies: expected at least one strategy to profile")
    repeated = sorted({name for name in strategies if list(strategies).count(name) > 1})
    if repeated:
        raise ValueError(f"strategies: {', '.join(repeated)} given twice; name each strategy once")
    specs = [replace(spec, strategy=name, relaunch=None) for name in strategies]
    for each in specs:
        checked_devices(each)
    return specs


def profile_strategies(spec: ProfileSpec, strategies: Sequence[str]) -> list[Report]:
    """Each strategy's report (its meta holds the strategy and the last loss), in the order given."""
    reports = []
    for each in strategy_specs(spec, strategies):
        if strategy_class(each.strategy).needs_launcher():
            reports.append(_in_processes(each, len(checked_devices(each))))
            continue
        report, _ = profile(each)
        if report is None:  # (a rank other than 0, under a launcher around this process)
            raise RuntimeError("profile_strategies: run it outside a launcher; it starts the processes it needs")
        reports.append(report)
    return reports


def _in_processes(spec: ProfileSpec, processes: int) -> Report:
    """The strategy profiled in `processes` processes of its own; rank 0's report of every rank's devices."""
    with tempfile.TemporaryDirectory(prefix="dpkit-profile-") as folder:
        spec_path, out_path = Path(folder, "spec.pickle"), Path(folder, "report.pickle")
        spec_path.write_bytes(pickle.dumps(replace(spec, json=None, png=None, trace=None)))
        relaunch(Command(WORKER, (str(spec_path), str(out_path))), processes)
        report = pickle.loads(out_path.read_bytes())
    if not isinstance(report, Report):
        raise RuntimeError(f"profile: the processes of strategy '{spec.strategy}' handed back no report")
    return report


def run_strategies(spec: ProfileSpec, strategies: Sequence[str]) -> list[Report]:
    """Profile each strategy, print the side-by-side table (and what each strategy adds to its own table), and
    write spec.json (one report per strategy under "runs"), spec.png and spec.trace (a file per strategy)."""
    reports = profile_strategies(spec, strategies)  # every strategy's settings checked before the first one runs
    first = reports[0].meta
    on_devices = ", ".join(dict.fromkeys(d.device for report in reports for d in report.devices))
    print(
        f"dpkit profile: {first['model'] or spec.example}, strategies {', '.join(strategies)}, batch "
        f"{first['batch_size']}, precision {spec.precision}, {spec.steps} observed step(s) after {spec.warmup} "
        f"warm-up, on {on_devices}"
    )
    print(side_by_side_table(reports, strategies))
    for name, report in zip(strategies, reports):
        for line in _notes(report, spec.warmup):
            print(f"{name}: {line}")
    print(
        "last loss: " + ", ".join(f"{name} {report.meta['last_loss']:.6f}" for name, report in zip(strategies, reports))
    )
    if spec.json:
        runs = {
            "schema_version": SCHEMA_VERSION,
            "strategies": list(strategies),
            "runs": [r.to_dict() for r in reports],
        }
        print(f"wrote {write_json(runs, spec.json)}")
    if spec.png:
        title = f"{' vs '.join(strategies)}: memory and time per device"
        print(f"wrote {save_side_by_side_png(reports, strategies, spec.png, title)}")
    if spec.trace:
        for name, report in zip(strategies, reports):
            print(f"wrote {report.save_trace(trace_path(spec.trace, name))}")
    return reports


def _notes(report: Report, warmup: int) -> list[str]:
    """What a strategy's own table says beside it: why a balance left the peaks uneven, what a sharded strategy
    keeps, what compiling cost."""
    notes = [str(report.meta["balance_note"])] if report.meta.get("balance_note") else []
    sharding = sharding_line(report)
    if sharding:
        notes.append(sharding)
    if report.meta.get("compile") is not None:
        notes.append(compile_line(report.meta["compile"], warmup))
    return notes


def trace_path(path: str | Path, strategy: str) -> Path:
    """One strategy's trace file beside the one asked for: trace.json -> trace-dp.json."""
    path = Path(path)
    return path.with_name(f"{path.stem}-{strategy}{path.suffix}")


def worker_main(spec_path: str, out_path: str) -> int:
    """A process of a strategy with a process per device: profile, and rank 0 hands the report back."""
    spec = pickle.loads(Path(spec_path).read_bytes())
    report, _ = profile(spec)
    if report is not None:
        Path(out_path).write_bytes(pickle.dumps(report))
    return 0


if __name__ == "__main__":
    if not launched():
        raise SystemExit(f"python -m {WORKER} SPEC OUT runs under dpkit's launcher, which profile_strategies starts")
    code = worker_main(*sys.argv[1:3])
    from dpkit.launch.worker import exit_worker

    exit_worker(code)
