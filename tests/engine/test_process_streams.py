"""Per-process streams and uneven ends (issue 45), in the suite's shared launched groups.

Each rank iterates its own batches (different counts, different row counts); every step's global batch is the
union of what the ranks hold, and the weights equal one device trained on those unions, rows weighted: under ddp,
fsdp, zero (both stages) and hsdp; with accumulation and clipping; with items= token weighting. A rank that runs
out sits out the remaining steps with zero weight (uneven="join"), and its reduce and gather are matched; with
uneven="stop" every rank stops at once naming it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from closeness import difference_to_scale
from dpkit.engine.engine import Engine

TOLERANCE = 1e-5  # relative to the largest weight: the layouts sum rows in different orders
# each rank's batches: (start, stop) rows of the data; rank 0 has 5 batches, rank 1 three of other sizes
PLANS = {0: [(0, 7), (7, 14), (14, 21), (21, 28), (28, 35)], 1: [(100, 104), (104, 109), (109, 115)]}


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(200, 6, generator=generator)
    return x, torch.randint(0, 3, (200,), generator=generator), torch.randint(1, 4, (200,), generator=generator)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor | None):
    """A mean over rows; with `tokens`, a sum over each row's tokens (its loss counted that many times)."""
    if tokens is None:
        return nn.functional.cross_entropy(net(x), y), None
    per_row = nn.functional.cross_entropy(net(x), y, reduction="none")
    return (per_row * tokens).sum(), int(tokens.sum())


def one_device(accumulate: int = 1, clip: float | None = None, items: bool = False) -> dict:
    """One device trained on each step's union of the ranks' batches (each micro-batch's union in turn)."""
    x, y, tokens = data()
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    steps = max(len(plan) for plan in PLANS.values())
    for first in range(0, steps - steps % accumulate, accumulate):  # (a window left incomplete does not step)
        optimizer.zero_grad()
        window = [
            [PLANS[r][i] for r in PLANS if i < len(PLANS[r])] for i in range(first, min(first + accumulate, steps))
        ]
        rows = torch.cat([torch.arange(a, b) for micro in window for a, b in micro])
        loss, count = loss_of(net, x[rows], y[rows], tokens[rows] if items else None)
        (loss / count if items else loss).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(net.parameters(), clip)
        optimizer.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def train_streams(strategy: str, options: dict, accumulate: int = 1, clip: float | None = None, items: bool = False):
    """In each process: its own stream of PLANS[rank], trained; the weights and what reduce/gather gave in the loop."""
    engine = Engine(strategy=strategy, accelerator="cpu", devices=2, progress=False, accumulate=accumulate, **options)
    x, y, tokens = data()
    net = model()
    wrapped, optimizer = engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.5))
    stream = [(x[a:b], y[a:b], tokens[a:b]) for a, b in PLANS[engine.rank]]
    rows_seen, gathered = [], []
    for bx, by, bt in engine.setup_dataloader(stream):
        optimizer.zero_grad()
        loss, count = loss_of(wrapped, bx, by, bt if items else None)
        engine.backward(loss, items=count)
        if clip is not None and engine.window_complete:
            engine.clip_gradients(optimizer, clip)
        optimizer.step()
        rows_seen.append(int(engine.reduce(len(by), "sum")))  # every rank's rows of this batch, a sitting-out one 0
        gathered.append(engine.gather(by).shape[0])
    weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in wrapped.state_dict().items()}
    engine.close()
    return {"weights": weights, "rows": rows_seen, "gathered": gathered}


LAYOUTS = [("ddp", {}), ("fsdp", {}), ("zero", {"stage": 1}), ("zero", {"stage": 2}), ("hsdp", {})]


def test_every_strategy_trains_uneven_streams_as_one_device_on_each_steps_union(groups):
    expected = one_device()
    unions = [sum(b - a for a, b in (PLANS[r][i] for r in PLANS if i < len(PLANS[r]))) for i in range(5)]
    for strategy, options in LAYOUTS:
        for rank, result in enumerate(groups(2).run(train_streams, strategy, options)):
            difference = difference_to_scale(result["weights"], expected)
            assert difference <= TOLERANCE, f"{strategy} {options} rank {rank}: {difference:.3g}"
            assert result["rows"] == unions == result["gathered"]  # the sitting-out rank adds nothing, and is matched


def test_accumulation_with_clipping_and_token_weighting(groups):
    for kwargs in ({"accumulate": 2, "clip": 0.05}, {"items": True}, {"accumulate": 2, "items": True}):
        expected = one_device(**kwargs)
        # (fsdp's sharded clipping with the first; the weighting is the Engine's, the same under both)
        for strategy, options in (("ddp", {}), ("fsdp", {})) if "clip" in kwargs else (("ddp", {}),):
            result = groups(2).run(train_streams, strategy, options, **kwargs)[0]
            difference = difference_to_scale(result["weights"], expected)
            assert difference <= TOLERANCE, f"{strategy} {kwargs}: {difference:.3g}"


def stop_at_the_uneven_end() -> str:
    from dpkit.engine.process_streams import StreamEnded

    engine = Engine(strategy="ddp", accelerator="cpu", devices=2, progress=False, uneven="stop")
    x, y, _ = data()
    net = model()
    wrapped, optimizer = engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.5))
    try:
        for bx, by in engine.setup_dataloader([(x[a:b], y[a:b]) for a, b in PLANS[engine.rank]]):
            optimizer.zero_grad()
            engine.backward(nn.functional.cross_entropy(wrapped(bx), by))
            optimizer.step()
    except StreamEnded as ended:
        said = str(ended)
    engine.close()
    return said


def test_uneven_stop_stops_every_rank_at_once_naming_the_one_that_ran_out(groups):
    said = groups(2).run(stop_at_the_uneven_end)
    assert (
        said[0]
        == said[1]
        == (
            "loader: rank 1 ran out of batches after 3 while the others had more (uneven='stop'); uneven='join' lets "
            "them sit out the remaining batches with zero weight"
        )
    )


def test_uneven_takes_join_or_stop():
    with pytest.raises(ValueError, match="uneven: expected 'join' .* or 'stop' .*, got 'pad'"):
        Engine(accelerator="cpu", devices=1, uneven="pad")


def evaluate_streams(strategy: str) -> tuple[float, float]:
    """In each process: an evaluation of its own stream adding up its sums and counts, reduced once at the end."""
    engine = Engine(strategy=strategy, accelerator="cpu", devices=2, progress=False)
    x, y, _ = data()
    net = model()
    wrapped = engine.setup(net)
    wrapped.eval()
    loss_sum, rows = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for bx, by in engine.setup_dataloader([(x[a:b], y[a:b]) for a, b in PLANS[engine.rank]]):
            loss_sum += nn.functional.cross_entropy(wrapped(bx), by, reduction="sum").double()
            rows += len(by)
    totals = float(engine.reduce(loss_sum, "sum")), float(engine.reduce(rows, "sum"))
    engine.close()
    return totals


def test_an_evaluation_over_uneven_streams_counts_every_sample_once(groups):
    x, y, _ = data()
    rows = torch.cat([torch.arange(a, b) for plan in PLANS.values() for a, b in plan])
    with torch.no_grad():
        expected = float(nn.functional.cross_entropy(model()(x[rows]), y[rows], reduction="sum"))
    for strategy in ("ddp", "fsdp"):
        for loss_sum, counted in groups(2).run(evaluate_streams, strategy):
            assert counted == len(rows)  # the rank that ran out sat out with zero rows, never its last batch again
            assert abs(loss_sum - expected) <= 1e-5 * abs(expected)
