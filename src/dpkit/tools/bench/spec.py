"""What a bench runs: the model and data, the strategies and device counts, the batch and the steps (BenchSpec),
checked before anything is built."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from dpkit.checks import check_int
from dpkit.parallel.balance import CALIBRATION_CALLS
from dpkit.precision import PRECISIONS
from dpkit.recipe.optimization import OPTIMIZERS
from dpkit.strategies import available_strategies, strategy_class
from dpkit.strategies.compression import parse_compression

log = logging.getLogger("dpkit")


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
    # gradient compression for the strategies that take it (the others run as they are); PowerSGD compresses from
    # the first measured step
    compress: str = "none"
    progress: bool = True

    def compresses(self, strategy: str) -> bool:
        """Whether `strategy`'s contender runs compressed: --compress given and the strategy takes it."""
        compression = parse_compression(self.compress)
        return compression.compresses and compression.kind in strategy_class(strategy).traits.compressions

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
        compression = parse_compression(self.compress)
        if compression.compresses and not any(self.compresses(name) for name in self.strategies):
            takers = [
                name for name in available_strategies() if compression.kind in strategy_class(name).traits.compressions
            ]
            raise ValueError(
                f"compress: none of the strategies benched ({', '.join(self.strategies)}) takes {str(compression)!r}; "
                f"it goes with {', '.join(takers)}"
            )
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
