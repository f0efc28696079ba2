"""Deterministic randomness for replicas on virtual CPU devices.

Every GPU has its own generator, so dropout in replicas on different GPUs is reproducible. Virtual CPU
devices all share torch's one CPU generator, and threads drawing from it race. Inside a replica's
thread this dispatch mode hands every random operator a per-replica generator, seeded from the
default generator by the calling thread, so the same seed gives bitwise-identical results.

The mode sees every operator a replica runs, which costs microseconds each. A RandomnessWatch lets a
caller whose replicas draw nothing stop paying for it: see there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("dpkit")

_TAKES_GENERATOR: dict[OpOverload, bool] = {}


def _takes_generator(func: OpOverload) -> bool:
    known = _TAKES_GENERATOR.get(func)
    if known is None:
        known = any(arg.name == "generator" for arg in func._schema.arguments)
        _TAKES_GENERATOR[func] = known
    return known


class ReplicaGenerator(TorchDispatchMode):
    """Routes random operators that use the default CPU generator to a generator seeded with `seed`.

    The generator is made on the first random operator, so replicas that draw nothing pay nothing for it.
    """

    def __init__(self, seed: int):
        super().__init__()
        self.seed = seed
        self.generator: torch.Generator | None = None

    # torch.compile (issue 34): without this dynamo skips every frame entered under the mode, so replicas ran
    # eagerly. Caveat: inductor's fused random ops do not dispatch here, so they draw from the default generator.
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(
        self, func: OpOverload, types: Sequence[type], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _takes_generator(func) and kwargs.get("generator") is None:
            if self.generator is None:
                self.generator = generator_for(self.seed)
            kwargs = dict(kwargs, generator=self.generator)
        return func(*args, **kwargs)


class RandomnessWatch:
    """Whether the replica jobs of one call site (a module in one training mode) draw random numbers,
    learned as they run; `begin` and `end` bracket each run.

    The first run protects every job with a ReplicaGenerator, which records whether it routed a draw. If
    none did, the seeds that run drew are given back to the default generator (a model without randomness
    leaves the caller's random stream as one device would, and a resumed run, whose watch learns again,
    draws what the uninterrupted one did), and later runs go without the mode; each of them compares the
    default CPU generator's state before and after instead, which costs microseconds. A change means a job
    drew from the shared generator (randomness that only starts later): that run's draws were not
    repeatable, a warning says so once, and every later run is protected again. A run whose jobs drew is
    protected from then on.
    """

    def __init__(self, name: str = "replicas"):
        self.name = name
        self.draws: bool | None = None  # unknown until a protected run finishes

    def protects(self) -> bool:
        return self.draws is not False

    def begin(self, n: int) -> tuple[list[ReplicaGenerator | None], torch.Tensor | None]:
        """For a run of n jobs: a generator per job (None while unprotected), and the default generator's
        state before the run (to give seeds back, or to see whether it moved) unless the jobs are known to draw."""
        state_before = torch.default_generator.get_state() if self.draws is not True else None
        modes: list[ReplicaGenerator | None] = [*replica_generators(n)] if self.protects() else [None] * n
        return modes, state_before

    def end(self, modes: Sequence[ReplicaGenerator | None], state_before: torch.Tensor | None) -> None:
        """Learn from the finished run that `begin` prepared."""
        if modes and modes[0] is not None:
            if any(mode is not None and mode.generator is not None for mode in modes):  # (all or none are None)
                self.draws = True
            elif state_before is not None:
                self.draws = False
                torch.default_generator.set_state(state_before)
        elif state_before is not None and not torch.equal(state_before, torch.default_generator.get_state()):
            log.warning(
                "%s drew random numbers from torch's shared CPU generator in a step after steps that drew "
                "none, so that step's draws (dropout masks, ...) are not repeatable from the seed; from now "
                "on every replica gets its own seeded generator again",
                self.name,
            )
            self.draws = True


class TrainingModeWatches:
    """One RandomnessWatch per training mode of a module (dropout draws in training and not in eval)."""

    def __init__(self, name: str):
        self.watches = {True: RandomnessWatch(name), False: RandomnessWatch(name)}

    def __call__(self, module: torch.nn.Module) -> RandomnessWatch:
        return self.watches[bool(module.training)]


def replica_seeds(n: int) -> list[int]:
    """n seeds drawn from the default CPU generator in the calling thread (so seeding torch fixes them)."""
    return [int(s) for s in torch.randint(0, 2**62, (n,), dtype=torch.int64)]


def replica_generators(n: int) -> list[ReplicaGenerator]:
    """One ReplicaGenerator per replica job, seeded from the default CPU generator in the calling thread."""
    return [ReplicaGenerator(seed) for seed in replica_seeds(n)]


def generator_for(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
