"""Token-weighted losses: `engine.backward(loss_sum, items=n)`.

A language model's loss is a mean over tokens, not rows: padding, `ignore_index` and uneven lengths give each
micro-batch and each device a different count, so averaging per-device or per-micro-batch means (what the
row weights do) is not the whole step's mean. With `items=n` the loop passes a sum over `n` items; each
backward adds the gradient of its sum (times the strategy's `sum_weight`, which undoes a mean exchange across
processes), and the backward that completes the accumulation window divides every gradient the optimizer
applies by the step's total count, summed over processes in one scalar reduction. The gradients are linear in
the loss, so dividing at the step is exact, and it comes before any clipping.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpkit.strategies import Strategy


def check_items(items: object) -> float:
    """`items` as a float: a count of at least 0 (a Python number or a one-element tensor)."""
    value = items.item() if isinstance(items, torch.Tensor) and items.numel() == 1 else items
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"items: expected the number of items (tokens, rows) the loss sums over, a count >= 0, got {items!r}"
        )
    return float(value)


class ItemCount:
    """The items of the current accumulation window's micro-batches on this process."""

    def __init__(self) -> None:
        self.items = 0.0
        self.micro_batches = 0  # backwards of the window given items=
        self.plain = 0  # backwards of the window without items=
        # the window's items over every process, when every micro-batch's total is known already (a per-process
        # stream's rows, exchanged before each batch): no reduction at the step then; None once one is not
        self.known: float | None = 0.0

    def add(self, items: float | None, known_total: float | None = None) -> None:
        if items is None:
            self.plain += 1
        else:
            self.items += items
            self.micro_batches += 1
            self.known = None if self.known is None or known_total is None else self.known + known_total
        if self.plain and self.micro_batches:
            self.reset()
            raise ValueError(
                "items: give items= to every engine.backward of an accumulation window or to none "
                "(a mean loss and a summed one cannot share a step)"
            )

    def reset(self) -> None:
        self.items, self.micro_batches, self.plain, self.known = 0.0, 0, 0, 0.0

    def finish(self, strategy: Strategy, model: nn.Module, window: int) -> None:
        """At the window's last backward: divide the gradients by the step's item count over every process."""
        counted, known, self.items, self.known = self.items, self.known, 0.0, 0.0
        summed, self.micro_batches, self.plain = self.micro_batches, 0, 0
        if not summed:
            return
        if known is not None:  # every micro-batch's total came with it: the same number on every process
            total = known
        else:
            total = strategy.items_in_step(counted)
        if total <= 0:
            raise ValueError(
                f"items: the step's {window} micro-batch{'es' if window > 1 else ''} hold 0 items on every "
                "process (all padding?); the step has no mean to take; skip such batches before engine.backward"
            )
        with torch.no_grad():
            for holders in strategy.gradient_holders(model):
                grads = [p.grad for p in holders if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, 1.0 / total)
