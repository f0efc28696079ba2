"""`dpkit bench`: one model under several strategies and device counts, measured in one run.

    result = run_bench(BenchSpec(example="wide-output", strategies=["single", "dp", "ddp"], device_counts=[1, 2]))
    print(result.format_table())

Each configuration trains the same model from the same initial weights with the same per-device batch
(weak scaling: N devices take N times the samples per step). The strategies that run in one process take
turns, one step each per round, so that drift of a shared machine hits every contender alike; a strategy
with one process per device runs in its own processes through dpkit's launcher, one launch per device
count, with a small worker (this module run with `--worker`). Step times are medians over the measured
steps after the warm-up ones. A few more steps run under an `dpkit.observe.Observer` for the time by
phase; they do not count in the medians, since observing costs time itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from dpkit.checks import check_int
from dpkit.devices import resolve_devices
from dpkit.launch import Command, relaunch
from dpkit.launch.environment import process_place
from dpkit.observe import Observer
from dpkit.observe.plots import save_scaling_figure
from dpkit.observe.report import write_json
from dpkit.observe.timing import PHASES
from dpkit.parallel.balance import CALIBRATION_CALLS
from dpkit.plan.profiles import measure_model
from dpkit.precision import PRECISIONS
from dpkit.recipe.optimization import OPTIMIZERS, build_optimizer
from dpkit.recipe.sources import criterion_for, model_source
from dpkit.strategies import PER_DEVICE, available_strategies, reference, strategy_class

log = logging.getLogger("dpkit")

SCHEMA_VERSION = 1
LOOP_PHASES = ("forward", "loss", "backward")  # what the bench times itself when a strategy does not report it
SHOWN_PHASES = tuple(PHASES) + tuple(p for p in ("all_reduce", "all_reduce_hidden") if p not in PHASES)


@dataclass
class BenchSpec:
    """What to run. The model comes from `example`, or from `model` ('pkg.mod:factory') with data from
    `data` ('pkg.mod:loader', loader(seed) -> x, y, ...) or synthetic inputs of `input_shape`."""

    example: str | None = "wide-output"
    model: str | None = None
    data: str | None = None
    input_shape: tuple[int, ...] | None = None
    strategies: list[str] = field(default_factory=available_strategies)
    device_counts: list[int] = field(default_factory=lambda: [1, 2, 3])
    batch_size_per_device: int | None = 64  # samples per device per step (weak scaling)
    batch_size: int | None = None  # instead: one global batch for every device count (strong scaling)
    steps: int = 10
    warmup: int = 3
    observed_steps: int = 3
    accelerator: str = "auto"
    precision: str = "32"
    optimizer: str = "adam"
    lr: float = 1e-3
    seed: int = 0
    threads_per_device: int = 1  # intra-op threads per virtual CPU device; 0: dpkit's fair share of the cores
    progress: bool = True

    def check(self) -> None:
        for name in self.strategies:
            strategy_class(name, argument="strategies")
        if not self.device_counts or any(not isinstance(n, int) or n < 1 for n in self.device_counts):
            raise ValueError(
                f"device_counts: expected positive device counts such as 1,2,3, got {self.device_counts!r}"
            )
        for name, low in (
            ("steps", 1),
            ("warmup", 0),
            ("observed_steps", 0),
            ("threads_per_device", 0),
        ):
            check_int(getattr(self, name), name, minimum=low)
        if self.model is None and self.example is None:
            raise ValueError("model/example: give a built-in example or a model factory")
        if self.model and not (self.data or self.input_shape):
            raise ValueError(
                "model: a factory needs data=package.module:loader or input_shape=3,32,32 (its per-sample shape)"
            )
        calibrating = [name for name in self.strategies if strategy_class(name).traits.balances]
        if calibrating and self.warmup < CALIBRATION_CALLS["memory"]:
            # a balancer observes its first steps, and an observer slows every contender while it runs
            log.warning(
                "warmup %d: %s calibrate(s) during the first %d steps, which slows the other contenders of those "
                "rounds; use a warm-up of %d or more",
                self.warmup,
                ", ".join(calibrating),
                CALIBRATION_CALLS["memory"],
                CALIBRATION_CALLS["memory"],
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if str(self.precision) not in PRECISIONS:
            raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if (self.batch_size is None) == (self.batch_size_per_device is None):
            raise ValueError(
                "batch_size/batch_size_per_device: give one, a global batch or a per-device one, got "
                f"{self.batch_size!r} and {self.batch_size_per_device!r}"
            )
        name = "batch_size" if self.batch_size is not None else "batch_size_per_device"
        check_int(getattr(self, name), name)
        uneven = [n for n in self.device_counts if self.batch_size is not None and self.batch_size % n]
        if uneven:
            raise ValueError(
                f"batch_size: {self.batch_size} does not split evenly over {uneven[0]} devices; a global batch "
                f"for comparing device counts must (e.g. {math.lcm(*self.device_counts) * 8}), or use "
                "batch_size_per_device"
            )

    def batch_description(self) -> str:
        if self.batch_size is None:
            return f"batch {self.batch_size_per_device} per device"
        return f"global batch {self.batch_size}"

    def per_device(self, devices: int) -> int:
        """Samples per device per step on `devices` devices."""
        if self.batch_size is not None:
            return self.batch_size // devices
        assert self.batch_size_per_device is not None  # check(): one of the two is given
        return self.batch_size_per_device


@dataclass
class ConfigResult:
    strategy: str
    devices: int
    step_seconds: float
    step_seconds_samples: list[float]
    phase_seconds: dict[str, float]
    samples_per_second: float = 0.0
    speedup: float = 0.0
    efficiency: float = 0.0
    lost: dict[str, float] = field(default_factory=dict)  # fraction of this step lost to each phase vs one device
    fastest_step_seconds: float = 0.0  # the least disturbed step
    interleaved: bool = True  # took turns with the others, round by round (ddp, fsdp run in their own processes)
    reference_seconds_samples: list[float] = field(default_factory=list)  # the reference work of each step's round

    def summary(self) -> str:
        text = f"{self.devices} device{'s' if self.devices > 1 else ''}: {self.speedup:.2f}x ({self.efficiency:.0%})"
        parts = [
            f"{name} {share:.0%}" for name, share in sorted(self.lost.items(), key=lambda kv: -kv[1]) if share >= 0.005
        ]
        return text + (f"; lost to {', '.join(parts)}" if parts else "")


@dataclass
class BenchResult:
    spec: BenchSpec
    profile: dict[str, Any]
    machine: dict[str, Any]
    results: list[ConfigResult]

    def baseline(self) -> ConfigResult:
        one_device = [r for r in self.results if r.devices == 1]
        return next(
            (r for r in one_device if r.strategy == reference()), one_device[0] if one_device else self.results[0]
        )

    def to_dict(self) -> dict[str, Any]:
        spec = asdict(self.spec)
        spec.pop("progress")
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "dpkit-bench",
            "spec": spec,
            "model": self.profile,
            "machine": self.machine,
            "batch_size_per_device": self.spec.batch_size_per_device,
            "batch_size": self.spec.batch_size,
            "optimizer": self.spec.optimizer,
            "precision": str(self.spec.precision),
            "results": [{**asdict(r), "summary": r.summary()} for r in self.results],
        }

    def save_json(self, path: str | os.PathLike) -> Path:
        return write_json(self.to_dict(), path)

    def format_table(self) -> str:
        phases = [p for p in SHOWN_PHASES if any(p in r.phase_seconds for r in self.results)]
        header = (
            ["strategy", "devices", "step ms", "samples/s", "speedup", "eff"]
            + [f"{p} ms" for p in phases]
            + ["where it went"]
        )
        rows = []
        for r in self.results:
            row = [
                r.strategy,
                str(r.devices),
                f"{r.step_seconds * 1e3:.2f}",
                f"{r.samples_per_second:,.0f}",
                f"{r.speedup:.2f}x",
                f"{r.efficiency:.0%}",
            ]
            row += [f"{r.phase_seconds[p] * 1e3:.2f}" if p in r.phase_seconds else "-" for p in phases]
            row.append(r.summary().split(": ", 1)[1])
            rows.append(row)
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
        lines = ["  ".join(h.rjust(w) if i < len(header) - 1 else h for i, (h, w) in enumerate(zip(header, widths)))]
        lines += [
            "  ".join(c.rjust(w) if i < len(header) - 1 else c for i, (c, w) in enumerate(zip(row, widths)))
            for row in rows
        ]
        return "\n".join(lines)

    def save_png(self, path: str | os.PathLike) -> Path:
        """Left: samples/s against devices per strategy; right: stacked time by phase per configuration."""
        throughput: dict[str, list[tuple[int, float]]] = {}
        for r in self.results:
            throughput.setdefault(r.strategy, []).append((r.devices, r.samples_per_second))
        return save_scaling_figure(
            path,
            throughput,
            [(f"{r.strategy}\n{r.devices}", r.phase_seconds) for r in self.results],
            [p for p in SHOWN_PHASES if not p.endswith("_hidden")],  # hidden time is inside another phase
            title=f"throughput, {self.spec.batch_description()}",
            throughput_label="samples/s (median step)",
            phase_label="ms per observed step (slowest device per phase)",
            linear_from=self.baseline().samples_per_second,
            reference=reference(),
        )


# ---- model and data -------------------------------------------------------------------------------


def load_model_source(spec: BenchSpec) -> tuple[Callable[[], nn.Module], torch.Tensor, torch.Tensor, str]:
    """(factory, x, y, name): the model factory and the data rows to cut batches from."""
    source = model_source(
        spec.example,
        spec.model,
        spec.data,
        input_shape=spec.input_shape,
        synthetic_rows=max(256, max(spec.per_device(n) * n for n in spec.device_counts)),
    )
    x, y = source.load_data(spec.seed)[:2]
    return source.build_model, x, y, source.name


def batch_rows(step: int, rows: int, total_rows: int) -> torch.Tensor:
    """Row indices of the step's global batch, cycling through the data."""
    start = (step * rows) % total_rows
    return torch.arange(start, start + rows) % total_rows


# ---- one in-process contender ---------------------------------------------------------------------


class Contender:
    """One (strategy, devices) configuration with its own engine, model copy and optimizer."""

    def __init__(
        self,
        spec: BenchSpec,
        strategy: str,
        devices: int,
        factory: Callable[[], nn.Module],
        x: torch.Tensor,
        y: torch.Tensor,
        rank: int = 0,
        world_size: int = 1,
    ):
        from dpkit.engine.engine import Engine

        self.strategy, self.devices = strategy, devices
        options: dict[str, Any] = {}  # the strategy's own options
        # one thread count for every contender: OpenMP threads are per calling thread, and on a busy
        # machine a contender with more threads than free cores loses most of its time spinning
        self.threads = spec.threads_per_device or None
        self.traits = strategy_class(strategy).traits
        if self.threads and spec.accelerator == "cpu" and "threads_per_device" in strategy_class(strategy).options:
            options["threads_per_device"] = self.threads
        self.engine = Engine(
            strategy=strategy,
            accelerator=spec.accelerator,
            devices=devices,
            precision=str(spec.precision),
            progress=False,
            **options,
        )
        torch.manual_seed(spec.seed)  # every contender starts from the same weights
        model = factory()
        momentum = 0.9 if spec.optimizer == "sgd" else 0.0
        optimizer = build_optimizer(spec.optimizer, model.parameters(), spec.lr, momentum, weight_decay=0.0)
        self.model, self.optimizer = self.engine.setup(model, optimizer)
        self.criterion = self.engine.setup_criterion(criterion_for(y))
        self.x, self.y = x, y
        self.rank, self.world_size = rank, world_size
        # the global batch of a step: per-device batch x all devices (ddp: this process's share of it)
        self.global_rows = spec.per_device(devices * world_size) * devices * world_size
        self.share_rows = spec.per_device(devices * world_size) * devices
        self.step_index = 0
        self.wrapped: tuple[str, ...] = LOOP_PHASES  # loop phases the bench times itself under an observer
        self.times: list[float] = []
        self.reference_times: list[float] = []

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = batch_rows(self.step_index, self.global_rows, len(self.x))
        rows = rows[self.rank * self.share_rows : (self.rank + 1) * self.share_rows]
        self.step_index += 1
        device = self.engine.device
        return self.x[rows].to(device), self.y[rows].to(device)

    def step(self, observer: Observer | None = None) -> float:
        """One training step; its wall time in seconds."""
        x, y = self.batch()
        if self.threads and self.engine.device.type == "cpu" and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # the calling thread runs backward and the optimizer

        def timed(name: str) -> contextlib.AbstractContextManager[None]:
            return observer.phase(name) if observer is not None and name in self.wrapped else contextlib.nullcontext()

        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        with timed("forward"):
            output = self.model(x)
        with timed("loss"):
            loss = self.criterion(output, y)
        del output
        with timed("backward"):
            self.engine.backward(loss)
        self.optimizer.step()
        if self.traits.processes == PER_DEVICE:
            loss.item()  # the step is over when every rank's all-reduce is
        return time.perf_counter() - start

    def observe(self, steps: int) -> dict[str, float]:
        """Seconds per step by phase (slowest device for each phase), over `steps` observed steps.

        One trial step first finds the loop phases the strategy already reports through the observer,
        so that the bench times only the others and nothing is counted twice."""
        if steps == 0:
            return {}
        self.wrapped = ()
        with Observer(memory=False, trace=False) as trial:
            trial.watch(self.model)  # names the home device, so the report has a row for it
            self.step(trial)
        reported = {phase for device in trial.report().devices for phase in device.seconds_by_phase}
        self.wrapped = tuple(p for p in LOOP_PHASES if p not in reported)
        home = self.engine.device if self.traits.one_device_per_process else None
        per_step: list[dict[str, float]] = []
        for _ in range(steps):  # one observer per step: a median per phase shrugs off a step the machine stalled
            with Observer(home, memory=False, trace=False) as observer:
                observer.watch(self.model)
                self.step(observer)
            slowest: dict[str, float] = {}
            for device in observer.report().devices:
                for phase, seconds in device.seconds_by_phase.items():
                    slowest[phase] = max(slowest.get(phase, 0.0), seconds)
                for phase, seconds in getattr(device, "hidden_seconds_by_phase", {}).items():
                    slowest[f"{phase}_hidden"] = max(slowest.get(f"{phase}_hidden", 0.0), seconds)
            per_step.append(slowest)
        names = dict.fromkeys(name for step in per_step for name in step)
        phase_seconds = {name: statistics.median([step.get(name, 0.0) for step in per_step]) for name in names}
        if "all_reduce" in phase_seconds:
            # ddp's all-reduce runs while backward computes: keep only what backward waited for (exposed) in
            # the step's sum, and the rest as all_reduce_hidden; the bench's backward timer includes the wait
            hidden = min(phase_seconds.get("all_reduce_hidden", 0.0), phase_seconds["all_reduce"])
            exposed = phase_seconds["all_reduce"] - hidden
            phase_seconds["all_reduce"] = exposed
            phase_seconds["all_reduce_hidden"] = hidden
            if "backward" in self.wrapped and "backward" in phase_seconds:
                phase_seconds["backward"] = max(0.0, phase_seconds["backward"] - exposed)
        return phase_seconds

    def close(self) -> None:
        self.engine.close()


# ---- a process per device, through the launcher ---------------------------------------------------


def run_in_processes(spec: BenchSpec, strategy: str, devices: int) -> tuple[list[float], dict[str, float]]:
    """Launch `devices` worker processes of `strategy`; rank 0's step times and phase seconds."""
    with tempfile.TemporaryDirectory(prefix="dpkit-bench-") as folder:
        spec_path, out_path = Path(folder, "spec.json"), Path(folder, "out.json")
        worker_spec = asdict(spec)
        worker_spec.update(progress=False, device_counts=[devices], strategies=[strategy])
        spec_path.write_text(json.dumps(worker_spec))
        relaunch(Command("dpkit.tools.bench", ("--worker", str(spec_path), str(out_path))), devices)
        measured = json.loads(out_path.read_text())
    return measured["times"], measured["phase_seconds"]


def worker_main(spec_path: str, out_path: str) -> int:
    """A worker process: warm up, time the steps, observe a few; rank 0 writes what it measured."""
    data = json.loads(Path(spec_path).read_text())
    if data.get("input_shape"):
        data["input_shape"] = tuple(data["input_shape"])
    spec = BenchSpec(**data)
    factory, x, y, _ = load_model_source(spec)
    place = process_place()
    world_size, rank = place.world_size, place.rank
    contender = Contender(spec, spec.strategies[0], world_size, factory, x, y, rank=rank, world_size=1)
    # under the launcher, `devices` is this node's process count; every rank cuts its own share
    contender.share_rows = spec.per_device(world_size)
    contender.global_rows = spec.per_device(world_size) * world_size
    for _ in range(spec.warmup):
        contender.step()
    times = [contender.step() for _ in range(spec.steps)]
    phase_seconds = contender.observe(spec.observed_steps)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"times": times, "phase_seconds": phase_seconds}))
    contender.close()
    return 0


# ---- the whole bench ------------------------------------------------------------------------------


def lost_by_phase(result: ConfigResult, baseline: ConfigResult) -> dict[str, float]:
    """The share of this configuration's step that the one-device step did not spend, by phase:
    phases that grew (communication, serialised launches, shared compute) against the baseline's."""
    lost_total = max(0.0, 1.0 - baseline.step_seconds / result.step_seconds) if result.step_seconds > 0 else 0.0
    step_phases = {phase: seconds for phase, seconds in result.phase_seconds.items() if not phase.endswith("_hidden")}
    grown = {phase: seconds - baseline.phase_seconds.get(phase, 0.0) for phase, seconds in step_phases.items()}
    grown = {phase: extra for phase, extra in grown.items() if extra > 0}
    observed_total = sum(step_phases.values())
    if not grown or lost_total == 0 or observed_total == 0:
        return {"other": lost_total} if lost_total > 0.005 else {}
    # observed steps run slower than the timed ones (observing costs); express growth in their scale
    shares = {phase: extra / observed_total for phase, extra in grown.items()}
    explained = sum(shares.values())
    if explained > lost_total:  # never claim more than was lost
        shares = {phase: share * lost_total / explained for phase, share in shares.items()}
    elif lost_total - explained > 0.005:
        shares["other"] = lost_total - explained
    return shares


class ReferenceWork:
    """A fixed single-thread matrix product timed once per round beside the contenders: how fast the
    machine was during this run. Two runs on a machine that other work loads differently can be
    compared by the ratio of their reference times (the calibration test does)."""

    def __init__(self, size: int = 256, repeats: int = 30):  # ~15 ms: longer than a scheduler slice, like a step
        generator = torch.Generator().manual_seed(0)
        self.a = torch.randn(size, size, generator=generator)
        self.repeats = repeats
        self.times: list[float] = []
        self.reference_times: list[float] = []

    def run(self) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        start = time.perf_counter()
        for _ in range(self.repeats):
            torch.mm(self.a, self.a)
        self.times.append(time.perf_counter() - start)
        torch.set_num_threads(threads)


def _in_processes(strategy: str) -> bool:
    """Whether the strategy runs in processes of its own (one per device), not as a contender in this one."""
    return strategy_class(strategy).traits.processes == PER_DEVICE


def run_bench(spec: BenchSpec) -> BenchResult:
    return run_benches([spec])[0]


def run_benches(specs: list[BenchSpec]) -> list[BenchResult]:
    """Several benches at once (two models, two batch sizes, ...): every in-process contender of every
    spec takes its turn in the same rounds, so that the load of a shared machine hits them all alike and
    their results can be compared with each other. Each spec runs its own warm-up and measured steps."""
    if not specs:
        raise ValueError("specs: expected at least one BenchSpec")
    for spec in specs:
        spec.check()
    sources, plans = [], []
    for spec in specs:
        factory, x, y, name = load_model_source(spec)
        profile = measure_model(factory, tuple(x.shape[1:]), input_dtype=x.dtype, name=name)
        configs = [
            (s, n)
            for s in spec.strategies
            for n in spec.device_counts
            if (most := strategy_class(s).traits.max_devices) is None or n <= most
        ]
        if (reference(), 1) not in configs:
            configs.insert(0, (reference(), 1))  # the reference every speed-up is measured against
        sources.append((factory, x, y, profile))
        plans.append(configs)
    total_steps = sum(
        len([c for c in configs if not _in_processes(c[0])]) * (spec.warmup + spec.steps + spec.observed_steps + 1)
        + len([c for c in configs if _in_processes(c[0])])
        for spec, configs in zip(specs, plans)
    )
    times: list[dict[tuple[str, int], list[float]]] = [{} for _ in specs]
    phases: list[dict[tuple[str, int], dict[str, float]]] = [{} for _ in specs]
    reference_work = ReferenceWork()
    with tqdm(
        total=total_steps, desc="dpkit bench", unit="step", disable=not any(spec.progress for spec in specs)
    ) as bar:
        contenders: list[tuple[int, Contender]] = []
        try:
            for index, (spec, configs, (factory, x, y, _)) in enumerate(zip(specs, plans, sources)):
                contenders += [
                    (index, Contender(spec, s, n, factory, x, y)) for s, n in configs if not _in_processes(s)
                ]
            rounds = max(spec.warmup + spec.steps for spec in specs)
            for round_index in range(rounds):
                reference_work.run()
                for index, contender in contenders:  # interleaved: one step each per round
                    spec = specs[index]
                    if round_index >= spec.warmup + spec.steps:
                        continue
                    seconds = contender.step()
                    if round_index >= spec.warmup:
                        contender.times.append(seconds)
                        contender.reference_times.append(reference_work.times[-1])
                    bar.update()
            for index, contender in contenders:
                key = (contender.strategy, contender.devices)
                phases[index][key] = contender.observe(specs[index].observed_steps)
                times[index][key] = contender.times
                bar.update(specs[index].observed_steps + 1)
        finally:
            for _, contender in contenders:
                contender.close()
        for index, (spec, configs) in enumerate(zip(specs, plans)):
            for strategy, devices in (c for c in configs if _in_processes(c[0])):
                bar.set_postfix_str(f"{strategy} x{devices} (processes)")
                times[index][(strategy, devices)], phases[index][(strategy, devices)] = run_in_processes(
                    spec, strategy, devices
                )
                bar.update()
    references = {(index, c.strategy, c.devices): c.reference_times for index, c in contenders}
    benches = []
    for index, (spec, configs, (_, _, _, profile)) in enumerate(zip(specs, plans, sources)):
        results = [
            ConfigResult(
                s,
                n,
                statistics.median(times[index][(s, n)]),
                times[index][(s, n)],
                phases[index][(s, n)],
                fastest_step_seconds=min(times[index][(s, n)]),
                interleaved=not _in_processes(s),
                reference_seconds_samples=references.get((index, s, n), []),
            )
            for s, n in configs
        ]
        machine = machine_description(spec)
        machine["reference_seconds"] = statistics.median(reference_work.times) if reference_work.times else None
        bench = BenchResult(spec, profile.to_dict(), machine, results)
        baseline = bench.baseline()
        for result in results:
            result.samples_per_second = spec.per_device(result.devices) * result.devices / result.step_seconds
            result.speedup = result.samples_per_second / baseline.samples_per_second
            result.efficiency = result.speedup / result.devices
            result.lost = lost_by_phase(result, baseline) if result is not baseline else {}
        benches.append(bench)
    return benches


def machine_description(spec: BenchSpec) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    devices = resolve_devices(spec.accelerator, 1)
    described = {
        "accelerator": devices[0].type,
        "cores": cores,
        "torch": torch.__version__,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if devices[0].type == "cuda":
        described["device_name"] = torch.cuda.get_device_name(0)
    return described


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m dpkit.tools.bench",
        description="dpkit bench's worker for a strategy with a process per device (started by the launcher)",
    )
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), required=True)
    arguments = parser.parse_args()
    code = worker_main(*arguments.worker)
    from dpkit.launch.worker import exit_worker

    exit_worker(code)
