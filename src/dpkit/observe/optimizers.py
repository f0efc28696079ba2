"""Optimizer steps: timed as the "optimizer" phase and their state charged as optimizer_state, for any
optimizer of any strategy (torch's global step hooks), on the device that holds its parameters."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from dpkit.observe.observer import Observer


class _ShardAwareHook:
    dpkit_shard_aware = True  # replica_optimizers.py looks for it

    def __init__(self, hook: Callable[..., Any]):
        self.hook = hook

    def __call__(self, *args: Any) -> Any:
        return self.hook(*args)


def shard_aware(hook: Callable[..., Any]) -> _ShardAwareHook:
    """A global step hook marked as one that may see replicated's shard optimizers (one per device thread)
    instead of the user's: with only such hooks registered, replicated still splits its step."""
    return _ShardAwareHook(hook)


class OptimizerWatch:
    """While started, every optimizer.step() in the process is a phase of the observer."""

    def __init__(self, observer: Observer):
        self.observer = observer
        self.seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # optimizers that stepped while observed
        self._handles: list[RemovableHandle] = []

    def start(self) -> None:
        self._handles = [
            register_optimizer_step_pre_hook(shard_aware(self._before_step)),
            register_optimizer_step_post_hook(shard_aware(self._after_step)),
        ]

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def device_of(self, optimizer: torch.optim.Optimizer) -> str | None:
        """Where the optimizer's parameters are charged (a replica's copy lives on its own virtual device)."""
        for group in optimizer.param_groups:
            for param in group["params"]:
                where = self.observer.ledger.where(param)
                if where is not None:
                    return where[0]
        return None

    def _before_step(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        self.seen.add(optimizer)
        device = self.device_of(optimizer)
        self.observer.watch_optimizer(optimizer, device)
        self.observer.enter_phase("optimizer", device)

    def _after_step(self, *_: object) -> None:
        self.observer.leave_phase("optimizer")
