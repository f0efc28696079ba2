"""One configuration of the bench (a strategy on a number of devices) with its own engine, model copy and
optimizer, stepped and observed; and the reference work that says how fast the machine was meanwhile."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dpkit.observe import Observer
from dpkit.recipe.optimization import build_optimizer
from dpkit.recipe.sources import criterion_for, model_source
from dpkit.strategies import PER_DEVICE, strategy_class
from dpkit.tools.bench.spec import BenchSpec

LOOP_PHASES = ("forward", "loss", "backward")  # what the bench times itself when a strategy does not report it


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
        if spec.compresses(strategy):
            options.update(compress=spec.compress, compress_warmup_steps=spec.warmup)
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
