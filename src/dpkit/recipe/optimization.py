"""The optimizer and learning-rate schedule of a recipe run (`dpkit train`).

The schedule is a pure function of the step: the learning rate of step k (0-based) is
lr * warm-up(k) * shape(k), with a linear warm-up over `lr_warmup_steps` steps and a constant or cosine shape
(cosine decays to 0 at step `steps`). It is applied through torch's LambdaLR on the user's optimizer, which
every strategy reads its hyperparameters from. Because it depends on nothing but the step, a resumed run
rebuilds it at the step it resumes from (`schedule_at`), with the learning rate, schedule or warm-up the
resume was explicitly allowed to change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

OPTIMIZERS = ("sgd", "adamw", "adam")
SCHEDULES = ("constant", "cosine")


def build_optimizer(
    name: str, params: Iterable[torch.nn.Parameter], lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    """sgd (with momentum), adamw or adam, with the run's learning rate and weight decay."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, got {name!r}")


def lr_factor(schedule: str, steps: int, warmup_steps: int) -> Callable[[int], float]:
    """step -> the multiple of the peak learning rate used at that (0-based) step."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        decay_steps = max(1, steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def schedule_at(
    optimizer: torch.optim.Optimizer, lr: float, schedule: str, steps: int, warmup_steps: int, step: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule positioned so that the next optimizer step (the run's step `step`, 0-based) uses its rate;
    the peak rate `lr` replaces whatever the optimizer's groups started from (a resumed run's change)."""
    for group in optimizer.param_groups:
        group["initial_lr"] = lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(schedule, steps, warmup_steps), last_epoch=step - 1)
