"""Random numbers in replicas drawn as one device drawing for the whole batch would draw them.

replica_rng.py gives every replica on a virtual CPU device a generator of its own: runs repeat bit for bit,
but a replica's dropout mask is not the rows of the mask one device draws for the whole batch, so a model
with dropout trains otherwise than on one device. Inside `WholeBatchDraws(state, offset, rows, total)` a
replica holding rows [offset, offset + rows) of a batch of `total` rows draws exactly those rows:

- it draws from a generator of its own that starts from `state`, the caller's default CPU generator state
  before the step (where one device would start);
- a random operator whose result has the replica's rows along dim 0 runs at the whole batch's size and the
  replica keeps its rows; any other random operator runs as it is (one device draws that tensor once, and
  every replica draws the same);
- so every replica's generator advances as one device's would, and `end_state()` is the state one device
  would leave: the caller sets its default generator to it (`finish_draws`).

Exact for operators whose result depends only on their shape and scalar arguments: dropout's bernoulli_,
normal_, uniform_ and the other in-place samplers, bernoulli(x, p), randn, rand, randint and their *_like
forms, provided every replica runs the same random operators in the same order. An operator that reads
tensor values (bernoulli(probabilities), multinomial) is drawn from the replica's generator as it is:
repeatable, not one device's numbers; `inexact` names it. Dim 0 is taken for the batch: a random tensor
that is not the batch's but happens to have as many rows as a replica is drawn as the batch's rows, the
replicas then draw differently, and `finish_draws` says so. The price: each replica draws the whole
batch's random numbers (N times the drawing, the arithmetic unchanged). GPUs draw from their own
generators; this mode is for virtual CPU devices, which share one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("dpkit")

aten = torch.ops.aten
_SEEDED = torch.Tag.nondeterministic_seeded

# operators that draw from the default generator without taking one: how to draw the same with one.
# ATen builds each of them as an empty tensor filled in place by the sampler named here.
_FACTORIES = {
    aten.randn.default: aten.randn.generator,
    aten.rand.default: aten.rand.generator,
    aten.randint.default: aten.randint.generator,
    aten.randint.low: aten.randint.low_generator,
    aten.randperm.default: aten.randperm.generator,
}
_LIKE = {
    aten.randn_like.default: lambda t, g, args: t.normal_(0.0, 1.0, generator=g),
    aten.rand_like.default: lambda t, g, args: t.uniform_(0.0, 1.0, generator=g),
    aten.randint_like.default: lambda t, g, args: t.random_(0, args[0], generator=g),
    aten.randint_like.low_dtype: lambda t, g, args: t.random_(args[0], args[1], generator=g),
}
# out-of-place operators whose tensor argument gives only the shape (its values are not read)
_SHAPE_ONLY = {aten.bernoulli.p}

_TAKES_GENERATOR: dict[OpOverload, bool] = {}


def _takes_generator(func: OpOverload) -> bool:
    known = _TAKES_GENERATOR.get(func)
    if known is None:
        known = _TAKES_GENERATOR[func] = any(arg.name == "generator" for arg in func._schema.arguments)
    return known


def _tensors(values: Sequence[object]) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor)]


class WholeBatchDraws(TorchDispatchMode):
    """Inside a replica's job: its random numbers are its rows of what one device would draw (module doc).

    state: the default CPU generator's state before the step (the same for every replica of the step);
    offset, rows: the replica's rows of the batch; total: the batch's rows.
    After the job: `drew` (whether it drew at all), `end_state()`, and `inexact` (operators it could not
    draw as one device would)."""

    def __init__(self, state: torch.Tensor, offset: int, rows: int, total: int):
        super().__init__()
        self.state = state
        self.offset, self.rows, self.total = offset, rows, total
        self.generator: torch.Generator | None = None
        self.inexact: list[str] = []

    @property
    def drew(self) -> bool:
        return self.generator is not None

    def end_state(self) -> torch.Tensor | None:
        return self.generator.get_state() if self.generator is not None else None

    def _generator(self) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator()
            self.generator.set_state(self.state)
        return self.generator

    def _batched(self, shape: Sequence[int]) -> bool:
        """Whether a tensor of this shape holds the replica's rows along dim 0 (and the batch is split)."""
        return self.rows != self.total and len(shape) > 0 and shape[0] == self.rows

    def _whole(self, shape: Sequence[int]) -> list[int]:
        return [self.total, *shape[1:]]

    def _mine(self, whole: torch.Tensor) -> torch.Tensor:
        return whole.narrow(0, self.offset, self.rows).clone()

    # torch.compile (issue 34): without this dynamo skips every frame entered under the mode, so replicas ran
    # eagerly. Caveat: inductor's fused random ops do not dispatch here, so they are not drawn as one device would.
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(
        self, func: OpOverload, types: Sequence[type], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in _FACTORIES:
            return self._factory(_FACTORIES[func], args, kwargs)
        if func in _LIKE:
            return self._like(func, args, kwargs)
        if not _takes_generator(func):
            if _SEEDED in func.tags:  # draws from the shared generator: neither repeatable nor one device's
                self.inexact.append(str(func))
            return func(*args, **kwargs)
        if kwargs.get("generator") is not None:  # the caller chose its generator
            return func(*args, **kwargs)
        kwargs["generator"] = self._generator()
        schema = func._schema
        first = args[0] if args else None
        tensors = _tensors(args) + _tensors(list(kwargs.values()))
        others = [t for t in tensors if t is not first]
        if isinstance(first, torch.Tensor) and schema.arguments[0].name == "self":
            if not self._batched(first.shape):
                return func(*args, **kwargs)
            if others:  # a sampler whose parameters are tensors of the replica's rows: no whole batch to draw
                self.inexact.append(str(func))
                return func(*args, **kwargs)
            if schema.is_mutable:  # bernoulli_, normal_, uniform_, ...: fill the replica's rows of a whole draw
                whole = first.new_empty(self._whole(first.shape))
                func(whole, *args[1:], **kwargs)
                with torch.no_grad():
                    first.copy_(whole.narrow(0, self.offset, self.rows))
                return first
            if func in _SHAPE_ONLY:
                return self._mine(func(first.new_empty(self._whole(first.shape)), *args[1:], **kwargs))
            self.inexact.append(str(func))  # it reads the values of the replica's rows
            return func(*args, **kwargs)
        size_at = next((k for k, a in enumerate(schema.arguments) if a.name == "size"), None)
        if size_at is not None and not tensors:
            return self._sized(func, size_at, args, kwargs)
        if any(self._batched(t.shape) for t in tensors):  # e.g. normal(means of the replica's rows)
            self.inexact.append(str(func))
        return func(*args, **kwargs)

    def _sized(self, func: OpOverload, size_at: int, args: tuple, kwargs: dict) -> torch.Tensor:
        """A factory with a size argument: drawn at the whole batch's size when its dim 0 is the rows."""
        values = list(args)
        size = values[size_at] if size_at < len(values) else kwargs.get("size")
        if size is None or not self._batched(list(size)):
            return func(*values, **kwargs)
        if size_at < len(values):
            values[size_at] = self._whole(list(size))
        else:
            kwargs["size"] = self._whole(list(size))
        return self._mine(func(*values, **kwargs))

    def _factory(self, with_generator: OpOverload, args: tuple, kwargs: dict) -> torch.Tensor:
        kwargs["generator"] = self._generator()
        if with_generator is aten.randperm.generator:
            if self._batched([args[0]]):  # a permutation of the batch's rows mixes replicas
                self.inexact.append("aten.randperm")
            return with_generator(*args, **kwargs)
        size_at = next(k for k, a in enumerate(with_generator._schema.arguments) if a.name == "size")
        return self._sized(with_generator, size_at, args, kwargs)

    def _like(self, func: OpOverload, args: tuple, kwargs: dict) -> torch.Tensor:
        source, rest = args[0], args[1:]
        dtype = kwargs.get("dtype") or source.dtype
        device = kwargs.get("device") or source.device
        batched = self._batched(source.shape)
        shape = self._whole(source.shape) if batched else list(source.shape)
        drawn = _LIKE[func](torch.empty(shape, dtype=dtype, device=device), self._generator(), rest)
        return self._mine(drawn) if batched else drawn


def finish_draws(state: torch.Tensor, modes: Sequence[WholeBatchDraws | None]) -> list[str]:
    """After a step whose replicas drew inside WholeBatchDraws modes started from `state`: set the default
    CPU generator where one device would have left it. Returns what was not one device's draws: operators
    that could not be drawn so, or replicas whose draws disagree (they ran different random operators)."""
    drawn = [mode for mode in modes if mode is not None]
    problems = sorted({name for mode in drawn for name in mode.inexact})
    ends = [end for mode in drawn if (end := mode.end_state()) is not None]  # the modes that drew
    if not ends:
        torch.default_generator.set_state(state)
        return problems
    if len(ends) != len(drawn) or any(not torch.equal(end, ends[0]) for end in ends[1:]):
        problems.append("replicas that drew different random numbers")
    torch.default_generator.set_state(ends[0])
    return problems
