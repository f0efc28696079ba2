"""Deterministic randomness for replicas on virtual CPU devices.

Every GPU has its own generator, so dropout in replicas on different GPUs is reproducible. Virtual CPU
devices all share torch's one CPU generator, and threads drawing from it race. Inside a replica's
thread this dispatch mode hands every random operator a per-replica generator, seeded from the
default generator by the calling thread, so the same seed gives bitwise-identical results.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_TAKES_GENERATOR: dict[Any, bool] = {}


def _takes_generator(func: Any) -> bool:
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _takes_generator(func) and kwargs.get("generator") is None:
            if self.generator is None:
                self.generator = generator_for(self.seed)
            kwargs = dict(kwargs, generator=self.generator)
        return func(*args, **kwargs)


def replica_seeds(n: int) -> list[int]:
    """n seeds drawn from the default CPU generator in the calling thread (so seeding torch fixes them)."""
    return [int(s) for s in torch.randint(0, 2**62, (n,), dtype=torch.int64)]


def generator_for(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
