"""The whole bench: every spec's configurations planned, the in-process contenders of every spec taking turns
round by round beside the reference work, then the strategies with a process per device in their own
processes; each spec's results with its speed-ups against the reference strategy on one device."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm import tqdm

from dpkit.plan.profiles import ModelProfile, measure_model
from dpkit.strategies import PER_DEVICE, reference, strategy_class
from dpkit.tools.bench.contender import Contender, ReferenceWork, load_model_source
from dpkit.tools.bench.processes import run_in_processes
from dpkit.tools.bench.results import BenchResult, ConfigResult, lost_by_phase, machine_description
from dpkit.tools.bench.spec import BenchSpec

Config = tuple[str, int]  # (strategy, devices)


def _in_processes(strategy: str) -> bool:
    """Whether the strategy runs in processes of its own (one per device), not as a contender in this one."""
    return strategy_class(strategy).traits.processes == PER_DEVICE


@dataclass
class _Planned:
    """One spec's model, data and configurations, and what was measured of each configuration."""

    spec: BenchSpec
    factory: Callable[[], nn.Module]
    x: torch.Tensor
    y: torch.Tensor
    profile: ModelProfile
    configs: list[Config]
    times: dict[Config, list[float]] = field(default_factory=dict)
    phases: dict[Config, dict[str, float]] = field(default_factory=dict)
    references: dict[Config, list[float]] = field(default_factory=dict)  # the reference work's, per round

    def in_this_process(self) -> list[Config]:
        return [config for config in self.configs if not _in_processes(config[0])]

    def in_own_processes(self) -> list[Config]:
        return [config for config in self.configs if _in_processes(config[0])]


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
    planned = [_plan(spec) for spec in specs]
    total_steps = sum(
        len(bench.in_this_process()) * (bench.spec.warmup + bench.spec.steps + bench.spec.observed_steps + 1)
        + len(bench.in_own_processes())
        for bench in planned
    )
    reference_work = ReferenceWork()
    with tqdm(
        total=total_steps, desc="dpkit bench", unit="step", disable=not any(spec.progress for spec in specs)
    ) as bar:
        _run_interleaved(planned, reference_work, bar)
        for bench in planned:
            for strategy, devices in bench.in_own_processes():
                bar.set_postfix_str(f"{strategy} x{devices} (processes)")
                bench.times[(strategy, devices)], bench.phases[(strategy, devices)] = run_in_processes(
                    bench.spec, strategy, devices
                )
                bar.update()
    return [_result(bench, reference_work) for bench in planned]


def _plan(spec: BenchSpec) -> _Planned:
    """The spec's model and data, its profile, and its configurations (the reference on one device first)."""
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
    return _Planned(spec, factory, x, y, profile, configs)


def _run_interleaved(planned: list[_Planned], reference_work: ReferenceWork, bar: tqdm) -> None:
    """Every in-process contender of every spec: one step each per round, then its observed steps."""
    contenders: list[tuple[_Planned, Contender]] = []
    try:
        for bench in planned:
            contenders += [
                (bench, Contender(bench.spec, s, n, bench.factory, bench.x, bench.y))
                for s, n in bench.in_this_process()
            ]
        rounds = max(bench.spec.warmup + bench.spec.steps for bench in planned)
        for round_index in range(rounds):
            reference_work.run()
            for bench, contender in contenders:  # interleaved: one step each per round
                spec = bench.spec
                if round_index >= spec.warmup + spec.steps:
                    continue
                seconds = contender.step()
                if round_index >= spec.warmup:
                    contender.times.append(seconds)
                    contender.reference_times.append(reference_work.times[-1])
                bar.update()
        for bench, contender in contenders:
            key = (contender.strategy, contender.devices)
            bench.phases[key] = contender.observe(bench.spec.observed_steps)
            bench.times[key] = contender.times
            bench.references[key] = contender.reference_times
            bar.update(bench.spec.observed_steps + 1)
    finally:
        for _, contender in contenders:
            contender.close()


def _result(bench: _Planned, reference_work: ReferenceWork) -> BenchResult:
    """One spec's results: medians, throughput, and speed-up and efficiency against its baseline."""
    spec = bench.spec
    results = [
        ConfigResult(
            s,
            n,
            statistics.median(bench.times[(s, n)]),
            bench.times[(s, n)],
            bench.phases[(s, n)],
            fastest_step_seconds=min(bench.times[(s, n)]),
            interleaved=not _in_processes(s),
            reference_seconds_samples=bench.references.get((s, n), []),
        )
        for s, n in bench.configs
    ]
    machine = machine_description(spec)
    machine["reference_seconds"] = statistics.median(reference_work.times) if reference_work.times else None
    result = BenchResult(spec, bench.profile.to_dict(), machine, results)
    baseline = result.baseline()
    for config in results:
        config.samples_per_second = spec.per_device(config.devices) * config.devices / config.step_seconds
        config.speedup = config.samples_per_second / baseline.samples_per_second
        config.efficiency = config.speedup / config.devices
        config.lost = lost_by_phase(config, baseline) if config is not baseline else {}
    return result
