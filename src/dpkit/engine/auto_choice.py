"""strategy="auto" on several devices in one process: decided once, from the first batch or a saved state.

Until then the Engine runs the reference strategy on the first device (its Placement lists the devices to
choose among). The decision is a new Placement; the Engine adopts it (its model, optimizers, criteria and
loaders follow the new strategy). Only strategies that drive every device from this process are candidates.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dpkit.engine.placement import Placement
from dpkit.parallel.nested import leaves
from dpkit.strategies import PER_DEVICE, matching, strategy_class


def _candidates(grad_scaler: bool) -> list[str]:
    """The strategies this process can run alone (with the GradScaler, when 16-mixed needs one)."""
    return matching(lambda traits: traits.processes != PER_DEVICE and (not grad_scaler or traits.grad_scaler))


def choose_from_batch(
    placement: Placement,
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    optimizer: torch.optim.Optimizer | str,
    *,
    grad_scaler: bool,
) -> tuple[Placement, str]:
    """The placement dpkit.choose_strategy picks for `model` on the model's first call (`args`, `kwargs`),
    among placement.auto_devices, and the choice's one-line reason."""
    sample = next(
        (leaf for _, leaf in leaves((args, kwargs), "inputs") if isinstance(leaf, torch.Tensor) and leaf.dim() > 0),
        None,
    )
    if sample is None:
        raise ValueError(
            "strategy: 'auto' chooses from the model's first batch, and its first call got no tensor with a batch "
            "dimension; pass the strategy by name, or strategy=dpkit.choose_strategy(model, inputs, batch_size, "
            "devices)"
        )
    # the planner is imported here, by the one process in a hundred that lets `auto` measure
    from dpkit.plan.auto import choose_strategy

    with torch.enable_grad():  # a brief measurement may train the probe models, even under no_grad
        choice = choose_strategy(
            model,
            sample,
            int(sample.shape[0]),
            list(placement.auto_devices),
            placement.precision,
            optimizer,
            can_launch=False,
            strategies=_candidates(grad_scaler),
        )
    return placement.decided(choice.strategy, placement.auto_devices[: choice.devices]), choice.reason


def choose_from_state(placement: Placement, saved: object, where: Path, *, grad_scaler: bool) -> tuple[Placement, str]:
    """The placement of the strategy a state in `where` was saved under, when this process can run it, and the
    line that says so; otherwise `placement` unchanged (the first batch still decides) and ""."""
    if saved not in _candidates(grad_scaler):
        return placement, ""
    most = strategy_class(saved).traits.max_devices
    devices = placement.auto_devices[: most or len(placement.auto_devices)]
    reason = f"auto: {saved} on {len(devices)} device(s), the strategy the state in {where} was saved under"
    return placement.decided(saved, devices), reason
