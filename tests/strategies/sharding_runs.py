"""What the sharding family's strategies (zero, hsdp) hold, measured as `dpkit profile` measures it (dpkit's
observer, by category) in every process of a launched group, and what the planner predicts for them."""

from __future__ import annotations

import torch
from fsdp_runs import Blocks, data
from torch import nn
from torch.distributed.tensor import DTensor

from dpkit.engine.engine import Engine

WIDTH = 64
STATE = ("parameters", "gradients", "optimizer_state")


def observed(strategy: str, devices: int, options: dict) -> dict:
    """Two observed Adam steps after one: the observer's books between steps, and each category's peak."""
    from dpkit.observe import Observer

    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False, **options)
    torch.manual_seed(3)
    model = Blocks(width=WIDTH)
    model, optimizer = engine.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    x, y = data().tensors

    def step() -> None:
        optimizer.zero_grad()
        engine.backward(nn.functional.cross_entropy(model(x[:32]), y[:32]))
        optimizer.step()

    step()
    with Observer(engine.device, models=engine.model_copies(), optimizers=[optimizer]) as observer:
        step()
        step()
    account = observer.ledger.accounts[str(engine.device)]
    result = {"kept": {name: account.current[name] for name in STATE}, "peaks": dict(account.category_peaks)}
    first = next(engine.model_copies()[0][0].parameters())
    if isinstance(first, DTensor):  # the mesh the shards live on: (replicate, shard) or (shard,)
        result["mesh"] = tuple(first.device_mesh.shape)
        result["placements"] = [type(placement).__name__ for placement in first.placements]
    engine.close()
    return result


def observed_many(runs: list[tuple[str, int, dict]]) -> list[dict]:
    return [observed(*run) for run in runs]


def predicted(strategy: str, devices: int, options: dict) -> dict[str, int]:
    """The planner's per-device bytes by category for the model `observed` trains (no activations: batch 0)."""
    from dpkit.plan.catalogue import Catalogue
    from dpkit.plan.configuration import Hardware, Setup
    from dpkit.plan.memory import memory_by_category
    from dpkit.plan.profiles import measure_model

    catalogue = Catalogue.load()
    hardware = Hardware(catalogue.gpu("h100-sxm"), catalogue.link("pcie4"))
    profile = measure_model(Blocks(width=WIDTH), (20,))
    setup = Setup(profile, hardware, strategy, devices, 0, optimizer="adam", options=options)
    return memory_by_category(setup)[0]


def scheduled(strategy: str, devices: int, options: dict, state: str, steps: int, save_at: int | None = None) -> dict:
    """SGD with a learning rate halved every step by a scheduler built on the user's optimizer before setup;
    saved at `save_at` into `state`, or resumed from it when `save_at` is None and it exists."""
    from pathlib import Path

    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False, **options)
    torch.manual_seed(3)
    model = Blocks()
    user = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(user, step_size=1, gamma=0.5)
    model, optimizer = engine.setup(model, user)
    x, y = data().tensors
    if save_at is None and Path(state).exists():
        engine.load_state(state, scheduler=scheduler)
    while engine.step < steps:
        optimizer.zero_grad()
        engine.backward(nn.functional.cross_entropy(model(x[:67]), y[:67]))
        optimizer.step()
        scheduler.step()
        if engine.step == save_at:
            engine.save_state(state, scheduler=scheduler)
    bare = engine.model_copies()[0][0]
    weights = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for name, p in bare.named_parameters()
    }
    engine.close()
    return {"weights": weights, "lr": optimizer.param_groups[0]["lr"]}


def scheduled_many(runs: list[tuple]) -> list[dict]:
    return [scheduled(*run) for run in runs]
