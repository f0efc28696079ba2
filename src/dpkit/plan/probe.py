"""This machine's cost-model constants for virtual CPU devices, measured on the spot in about a second.

`strategy="auto"` on virtual CPU devices needs what only this machine can say: how fast a device computes, how
many devices compute at full speed at once (free cores), what a kernel launch, a replica's module and a thread
hand-off cost, how the replica threads of one process serialise on the GIL. `dpkit bench --json` and
`dpkit plan --calibration` measure these on the user's model; when no calibration is given, this probe measures
them on two small fixed models instead (never the user's): one whose step is mostly launches (12
Linear(32, 32) + ReLU layers, 32 samples) and one whose step is mostly arithmetic (two 1024-wide layers, 1024
samples). Each is trained a few steps under the reference strategy on one device and under the one-process
strategies on N devices (DataParallel's per-step replicas, persistent replicas), in interleaved rounds so that
a busy machine's load hits them alike, one intra-op thread per device as `dpkit bench` runs them, the replicas'
jobs of each in the way a long run settles into (concurrency_decided: serially for the first, side by side for
the second; learning the way would take more steps than the probe has); the constants
are then fitted to those step times exactly as `dpkit plan --calibration` fits a bench run.

This module is the one place of plan/ that runs anything, and only these probes; the user's model is only
traced on the meta device (profiles.measure_model).

    calibration = probe_machine(2)      # cached per device count for the life of the process
    hardware, constants = calibration.for_hardware(None)
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpkit.devices import available_cores, cpu_devices, keep_freed_host_memory
from dpkit.parallel.concurrency import concurrency_decided
from dpkit.plan.calibration import BenchRun, Calibration, calibrate
from dpkit.plan.profiles import measure_model
from dpkit.strategies import (
    ON_ROOT,
    ONE_PROCESS,
    PER_STEP,
    PERSISTENT,
    DeferredOutput,
    create_strategy,
    matching,
    reference,
    strategy_class,
)

WARMUP_ROUNDS = 2
ROUNDS = 7  # measured rounds, at most
BUDGET_SECONDS = 2.0  # the measured rounds stop early past this, after MINIMUM_ROUNDS
MINIMUM_ROUNDS = 3
CLASSES = 10


@dataclass(frozen=True)
class ProbeModel:
    name: str
    build: Callable[[], nn.Module]
    features: int
    batch: int  # global batch, split across the devices
    # its replicas' jobs in turns (a step of many small operators) or side by side (long matrix products): the
    # way a call site learns to run them, fixed here, so that a few steps measure what a long run settles into
    way: str  # how its replicas run, as a long run of it settles: "serial" or "threads"


def _launch_probe() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(32, CLASSES))


def _compute_probe() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, CLASSES))


PROBES = (
    ProbeModel("probe: 12 Linear(32, 32) layers", _launch_probe, 32, 32, way="serial"),
    ProbeModel("probe: two 1024-wide layers", _compute_probe, 64, 1024, way="threads"),
)


def probe_strategies() -> list[str]:
    """The one-process strategies the probe runs on N devices, found by their traits: DataParallel's (replicas
    re-made every step, the loss on device 0) and persistent replicas."""
    wanted = []
    for predicate in (
        lambda t: t.processes == ONE_PROCESS and t.replicas == PER_STEP and t.loss == ON_ROOT and not t.balances,
        lambda t: t.processes == ONE_PROCESS and t.replicas == PERSISTENT,
    ):
        found = matching(predicate)
        if found:
            wanted.append(found[0])
    return wanted


class _Contender:
    """One (strategy, devices) configuration of one probe model: its own copy, strategy and optimizer."""

    def __init__(self, name: str, devices: int, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        self.name, self.devices = name, devices
        options: dict[str, Any] = (
            {"threads_per_device": 1} if "threads_per_device" in strategy_class(name).options else {}
        )
        self.strategy = create_strategy(name, cpu_devices(devices), **options)
        self.strategy.setup_environment()
        self.model = self.strategy.wrap_model(copy.deepcopy(model))
        self.optimizer = self.strategy.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9))
        self.criterion = self.strategy.wrap_criterion(nn.functional.cross_entropy)
        self.x, self.y = x, y
        self.times: list[float] = []

    def step(self) -> float:
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        output = self.model(self.x)
        if isinstance(output, DeferredOutput):
            loss = self.criterion(output, self.y)
        else:
            loss = nn.functional.cross_entropy(output, self.y)
        self.strategy.backward(loss, scale=1.0, sync=True)
        self.optimizer.step()
        return time.perf_counter() - start

    def close(self) -> None:
        self.strategy.teardown()


def measure_probes(devices: int, budget_seconds: float = BUDGET_SECONDS) -> list[BenchRun]:
    """Step times of the probe models under the reference strategy on one device and the probe strategies on
    `devices` virtual CPU devices, as bench runs (one per probe model) the calibration can fit. The caller's random
    state and intra-op thread count are left as they were."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 2:
        raise ValueError(f"devices: the probe compares one device with several; expected at least 2, got {devices!r}")
    keep_freed_host_memory()
    threads = torch.get_num_threads()
    contenders: list[tuple[int, _Contender]] = []
    try:
        torch.set_num_threads(1)  # as dpkit bench runs its contenders: one intra-op thread per device
        # auto chooses before training starts: the probe must not move the random state the user seeded
        with torch.random.fork_rng(devices=[]):
            generator = torch.Generator().manual_seed(0)
            for index, probe in enumerate(PROBES):
                torch.manual_seed(0)
                model = probe.build()
                x = torch.randn(probe.batch, probe.features, generator=generator)
                y = torch.randint(0, CLASSES, (probe.batch,), generator=generator)
                contenders.append((index, _Contender(reference(), 1, model, x, y)))
                contenders += [(index, _Contender(name, devices, model, x, y)) for name in probe_strategies()]
            for _ in range(WARMUP_ROUNDS):
                for index, contender in contenders:
                    with concurrency_decided(PROBES[index].way):
                        contender.step()
            started = time.perf_counter()
            for round_index in range(ROUNDS):
                for index, contender in contenders:
                    with concurrency_decided(PROBES[index].way):
                        contender.times.append(contender.step())
                if round_index + 1 >= MINIMUM_ROUNDS and time.perf_counter() - started > budget_seconds:
                    break
    finally:
        for _, contender in contenders:
            contender.close()
        torch.set_num_threads(threads)
    cores = available_cores()
    runs = []
    for index, probe in enumerate(PROBES):
        measured = [(c.name, c.devices, statistics.median(c.times)) for i, c in contenders if i == index and c.times]
        profile = measure_model(probe.build, (probe.features,), name=probe.name)
        runs.append(BenchRun(profile, 0, "sgd", "cpu", cores, measured, batch_size=probe.batch))
    return runs


@functools.lru_cache(maxsize=8)
def _probe(devices: int, cores: int) -> Calibration:
    calibration = calibrate(measure_probes(devices))
    calibration.source = f"a probe of this machine ({cores} cores, {devices} virtual devices)"
    return calibration


def probe_machine(devices: int) -> Calibration:
    """This machine's constants for `devices` virtual CPU devices (measured once per process and device count;
    about a second on an idle 2-core machine)."""
    return _probe(devices, available_cores())
