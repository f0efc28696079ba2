"""A run stopped and resumed from engine.save_state ends bitwise where the uninterrupted run ends.

Each run trains a small dropout MLP with momentum SGD on a shuffled loader (the order drawn from torch's
global generator, so the generator state matters) for STEPS optimizer steps, 6 batches per epoch, the
last one short. The interrupted runs stop at a step inside an epoch, at an epoch's end and in a later
epoch, save, and a fresh Engine in a fresh model resumes from the saved directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import dpkit
from closeness import assert_close_to_scale
from dpkit.checkpoint.model_files import clean_state_dict

STEPS = 14
FEATURES, CLASSES, SAMPLES, BATCH = 8, 3, 45, 8  # 6 batches per epoch, the last of 5 rows


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def build_model(dropout: float) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, CLASSES))


def loader_for(seeded_order: bool) -> DataLoader:
    data = dataset()
    if seeded_order:  # the same global batches for every strategy and world size
        return DataLoader(
            data, batch_size=BATCH, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(5))
        )
    return DataLoader(data, batch_size=BATCH, shuffle=True)


def run(
    strategy: str,
    devices: int,
    state_dir: Path,
    *,
    stop_at: int | None = None,
    resume: bool = False,
    seeded_order: bool = False,
    dropout: float = 0.3,
    steps: int = STEPS,
    close: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """Train up to `steps` (or save and stop at `stop_at`); the weights and the loss of every step run here."""
    engine = dpkit.Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False)
    torch.manual_seed(0)
    model = build_model(dropout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 4, 0.5)  # an extra object with state
    model, optimizer = engine.setup(model, optimizer)
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    loader = engine.setup_dataloader(loader_for(seeded_order))
    losses: dict[int, float] = {}
    if resume:
        extras = engine.load_state(state_dir, scheduler=scheduler)
        assert extras["note"] == f"stopped at {engine.step}"
    while engine.step < steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            engine.backward(loss)
            optimizer.step()
            scheduler.step()
            losses[engine.step] = loss.item()
            if engine.step == stop_at:
                engine.save_state(state_dir, keep=2, scheduler=scheduler, note=f"stopped at {engine.step}")
                if close:
                    engine.close()
                return clean_state_dict(model), losses
            if engine.step == steps:
                break
    if close:
        engine.close()
    return {k: v.clone() for k, v in clean_state_dict(model).items()}, losses


GLOBAL_DRAWS: list[bool] = []  # module level: replicas are copies of the model, so not an attribute


class DrawsInReplica(nn.Module):
    """Records whether a random draw inside a replica moved torch's global CPU generator."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = torch.default_generator.get_state()
        nn.functional.dropout(torch.ones(16), 0.5, training=True)
        GLOBAL_DRAWS.append(not torch.equal(before, torch.default_generator.get_state()))
        return self.linear(x)


def replicas_draw_from_their_own_generators() -> bool:
    """One replicated step: did any replica draw from the global generator (where threads race)?"""
    engine = dpkit.Engine(strategy="replicated", accelerator="cpu", devices=2, progress=False)
    model = DrawsInReplica()
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    x, y = dataset()[:8]
    GLOBAL_DRAWS.clear()
    engine.backward(criterion(model(x), y))
    engine.close()
    assert len(GLOBAL_DRAWS) == 2
    return not any(GLOBAL_DRAWS)


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs by {(a[key] - b[key]).abs().max().item():.3g}"


@pytest.mark.parametrize("strategy,devices", [("single", 1), ("dp", 2), ("dp-balanced", 2), ("replicated", 2)])
def test_resume_equals_uninterrupted_bitwise(tmp_path, strategy, devices):
    reference, reference_losses = run(strategy, devices, tmp_path / "unused")
    assert len(reference_losses) == STEPS
    if strategy == "replicated":
        # the precondition, not the resume: replicas that shared torch's global generator would race for it
        assert replicas_draw_from_their_own_generators()
    for stop_at in (3, 6, 10):  # mid-epoch, the end of the first epoch, inside the second
        state_dir = tmp_path / f"stop-{stop_at}"
        _, first_losses = run(strategy, devices, state_dir, stop_at=stop_at)
        weights, resumed_losses = run(strategy, devices, state_dir, resume=True)
        assert_bitwise(reference, weights, f"{strategy} stopped at {stop_at}")
        assert {**first_losses, **resumed_losses} == reference_losses
        assert min(resumed_losses) == stop_at + 1


def test_resume_twice_and_keep(tmp_path):
    reference, _ = run("single", 1, tmp_path / "unused")
    state_dir = tmp_path / "state"
    run("single", 1, state_dir, stop_at=4)
    engine_free_steps = []
    for stop_at in (7, 9, 12):
        run("single", 1, state_dir, stop_at=stop_at, resume=True)
        engine_free_steps.append(stop_at)
    assert sorted(p.name for p in state_dir.iterdir()) == ["latest", "step-00000009", "step-00000012"]  # keep=2
    weights, _ = run("single", 1, state_dir, resume=True)
    assert_bitwise(reference, weights, "resumed four times")


@pytest.mark.parametrize(
    "first,second",
    [
        (("single", 1), ("dp", 3)),
        (("dp", 3), ("replicated", 2)),
        (("replicated", 2), ("single", 1)),
        (("dp-balanced", 2), ("dp", 3)),
    ],
)
def test_resume_under_another_strategy_and_world_size(tmp_path, first, second):
    """The same global batches (a seeded sampler) and no dropout: a run saved under one strategy and world size
    and resumed under another ends where a single-device run ends, up to float32 rounding: splitting a batch
    over another number of replicas changes the order of the gradient sums, so bits may differ (dropout would
    also differ: its masks are drawn per replica)."""
    reference, reference_losses = run("single", 1, tmp_path / "unused", seeded_order=True, dropout=0.0)
    state_dir = tmp_path / "state"
    _, first_losses = run(*first, state_dir, stop_at=5, seeded_order=True, dropout=0.0)
    weights, losses = run(*second, state_dir, resume=True, seeded_order=True, dropout=0.0)
    assert sorted(losses) == list(range(6, STEPS + 1))
    assert_close_to_scale(weights, reference, what="weights against single's")  # (tests/closeness.py)
    for step, loss in {**first_losses, **losses}.items():
        assert loss == pytest.approx(reference_losses[step], rel=1e-5, abs=1e-6)


def ddp_resume_job(out: str, stop_at: int) -> dict:
    """In each process of a group: an uninterrupted ddp run, a run saved at `stop_at`, a fresh Engine that resumes
    it; one process group for the runs (each Engine finds it initialised; only the last one closes it)."""
    folder = Path(out)
    reference, reference_losses = run("ddp", 2, folder / "unused", close=False)
    _, first_losses = run("ddp", 2, folder / "state", stop_at=stop_at, close=False)
    run("ddp", 2, folder / "cross", stop_at=stop_at, seeded_order=True, dropout=0.0, close=False)  # resumed below
    weights, resumed_losses = run("ddp", 2, folder / "state", resume=True)
    return {
        "reference": reference,
        "reference_losses": reference_losses,
        "weights": weights,
        "losses": {**first_losses, **resumed_losses},
    }


def test_ddp_resume_equals_uninterrupted_bitwise(tmp_path, groups):
    """Two processes of a launched group: an uninterrupted run, a run saved at step 5 (mid-epoch), and a
    fresh Engine that resumes it, all in the same process group; each rank's weights and losses compare."""
    results = groups(2).run(ddp_resume_job, str(tmp_path), 5)
    for rank, result in enumerate(results):
        assert_bitwise(result["reference"], result["weights"], f"ddp rank {rank}")
        assert result["losses"] == result["reference_losses"] and len(result["losses"]) == STEPS
    assert sorted(p.name for p in (tmp_path / "state" / "step-00000005").iterdir()) == [
        "rank-0.pt",
        "rank-1.pt",
        "state.pt",
    ]

    # ddp on 2 processes -> replicated on 3 devices -> single: the data position is a global batch
    reference, reference_losses = run("single", 1, tmp_path / "unused", seeded_order=True, dropout=0.0)
    _, middle_losses = run("replicated", 3, tmp_path / "cross", resume=True, stop_at=9, seeded_order=True, dropout=0.0)
    weights, last_losses = run("single", 1, tmp_path / "cross", resume=True, seeded_order=True, dropout=0.0)
    assert sorted({**middle_losses, **last_losses}) == list(range(6, STEPS + 1))
    # float32 rounding only: the replicas' sums run in another order (see above)
    assert_close_to_scale(weights, reference, what="weights against single's")
