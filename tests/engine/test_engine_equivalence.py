"""The central property at the Engine, for every strategy in the registry: the same loop, the same seed and
the same global batches give the single-device gradients and weights (up to float rounding).

Strategies with a process per device run this module's `engine_run` in each process of a launched group;
the others run it here. A strategy added to the registry is checked here without a line of this file changing.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from closeness import difference_to_scale
from dpkit.engine.engine import Engine
from dpkit.strategies import PER_DEVICE, available_strategies, reference, strategy_class

STEPS = 5
TOLERANCE = 1e-5  # relative to the values' size (tests/closeness.py): the strategies sum in other orders


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(300, 20, generator=generator), torch.randint(0, 5, (300,), generator=generator))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as one device holds it: a sharded strategy's DTensor gathered (collective: every process calls it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def engine_run(
    strategy: str, devices: int, batch_size: int, accumulate: int = 1, clip: float | None = None
) -> dict[str, list[torch.Tensor]]:
    """STEPS optimizer steps of a plain Engine loop; the first step's gradients and the final weights, as this
    process's model (replica 0, or this rank's) holds them, and with `clip` every step's norm before clipping
    (engine.clip_gradients)."""
    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, accumulate=accumulate, progress=False)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    # made on the Engine's optimizer after setup, as torch's examples make theirs: it is a torch Optimizer
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    order = RandomSampler(range(300), generator=torch.Generator().manual_seed(5))
    loader = engine.setup_dataloader(DataLoader(data(), batch_size=batch_size, sampler=order))
    bare = engine.model_copies()[0][0]
    first_gradients, norms, micro_batches = None, [], 0
    while engine.step < STEPS:
        for x, y in loader:
            optimizer.zero_grad()
            engine.backward(criterion(model(x), y))
            micro_batches += 1
            if first_gradients is None and accumulate == 1:
                first_gradients = [whole(p.grad.detach()).clone() for p in bare.parameters()]
            if clip is not None and micro_batches % accumulate == 0:
                norms.append(float(engine.clip_gradients(optimizer, clip)))
            optimizer.step()
            if micro_batches % accumulate == 0:
                scheduler.step()
            if engine.step == STEPS:
                break
    weights = [whole(p.detach()).clone() for p in bare.parameters()]
    engine.close()
    return {"gradients": first_gradients or [], "weights": weights, "norms": torch.tensor(norms)}


def run(strategy: str, devices: int, batch_size: int, groups, accumulate: int = 1, clip: float | None = None) -> list:
    """The results of every process that ran the loop (one here, or one per device in a launched group)."""
    if strategy_class(strategy).traits.processes != PER_DEVICE:
        return [engine_run(strategy, devices, batch_size, accumulate, clip)]
    return groups(devices).run(engine_run, strategy, devices, batch_size, accumulate, clip)


def assert_close(mine: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    assert len(mine) == len(theirs) > 0, what
    difference = difference_to_scale(mine, theirs)
    assert difference <= TOLERANCE, f"{what}: {difference:.3g} of their size apart"


@pytest.fixture(scope="module")
def single_runs():
    runs: dict[tuple, dict] = {}

    def get(batch_size: int, accumulate: int = 1, clip: float | None = None) -> dict:
        key = (batch_size, accumulate, clip)
        if key not in runs:
            runs[key] = engine_run(reference(), 1, batch_size, accumulate, clip)
        return runs[key]

    return get


# (localsgd and diloco meet every few steps and change the optimization: tests/strategies/test_localsgd_diloco.py)
MULTI_DEVICE = [
    name
    for name in available_strategies()
    if strategy_class(name).traits.max_devices != 1 and strategy_class(name).traits.sync_every == 1
]


@pytest.mark.parametrize("devices,batch_size", [(2, 64), (3, 67)], ids=["2-even", "3-uneven"])
@pytest.mark.parametrize("strategy", MULTI_DEVICE)
def test_every_strategy_takes_the_single_device_step(strategy, devices, batch_size, single_runs, groups):
    single = single_runs(batch_size)
    for rank, result in enumerate(run(strategy, devices, batch_size, groups)):
        where = f"{strategy} on {devices} devices, batch {batch_size}, process {rank}"
        assert_close(result["gradients"], single["gradients"], f"{where}: first gradients")
        assert_close(result["weights"], single["weights"], f"{where}: weights after {STEPS} steps")


@pytest.mark.parametrize("strategy", MULTI_DEVICE)
def test_accumulated_micro_batches_take_the_single_device_step(strategy, single_runs, groups):
    single = single_runs(33, accumulate=2)
    for result in run(strategy, 2, 33, groups, accumulate=2):
        assert_close(result["weights"], single["weights"], f"{strategy} with accumulate=2")


@pytest.mark.parametrize("strategy", MULTI_DEVICE)
def test_clipped_gradients_take_the_single_device_step(strategy, single_runs, groups):
    single = single_runs(67, clip=0.25)
    assert (single["norms"] > 0.25).all()  # the clip acts on every step
    for rank, result in enumerate(run(strategy, 3, 67, groups, clip=0.25)):
        where = f"{strategy} clipped, on 3 devices, batch 67, process {rank}"
        assert_close(list(result["norms"]), list(single["norms"]), f"{where}: norms before clipping")
        assert_close(result["weights"], single["weights"], f"{where}: weights after {STEPS} steps")


def test_the_single_run_is_torchs_own_loop_with_its_schedule():
    """The reference is plain torch: the same model, data order, SGD and StepLR, without an Engine (so the
    scheduler made on the Engine's optimizer does set the learning rate every strategy above steps with)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        single = engine_run(reference(), 1, 64)
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]  # the scheduler saw optimizer.step()
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    order = RandomSampler(range(300), generator=torch.Generator().manual_seed(5))
    batches = iter(DataLoader(data(), batch_size=64, sampler=order))
    for _ in range(STEPS):
        x, y = next(batches)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** (STEPS // 2))
    assert_close(single["weights"], [p.detach() for p in model.parameters()], "single against torch's loop")


def test_the_runs_are_not_vacuous(single_runs):
    """The loop does move the weights, and the gradient is not zero: equality above means something."""
    single = single_runs(64)
    torch.manual_seed(3)
    initial = list(nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5)).parameters())
    assert max((a - b).abs().max().item() for a, b in zip(single["weights"], initial)) > 1e-2
    assert max(g.abs().max().item() for g in single["gradients"]) > 1e-3
