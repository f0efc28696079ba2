"""A loop that fetches the next batch before backward (nanoGPT's shape) is weighted by the batch its loss came from.

Under a strategy with a process per device each process's mean loss is scaled by its share of the global batch.
On 31 rows in batches of 16 over 2 processes the shares are 8+8, then 8+7: a loop holding the next batch when it
calls engine.backward must still get the share of the batch it computed the loss on, or the last step of every
epoch leans on the wrong rows (5e-3 off one device before the weight followed the forward).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpkit.engine.engine import Engine
from dpkit.engine.forward_batches import ForwardBatches
from dpkit.engine.resumable_loader import BatchRecord
from dpkit.strategies import PER_DEVICE, available_strategies, reference, strategy_class

ROWS, BATCH, EPOCHS = 31, 16, 2
TOLERANCE = 1e-5  # relative to the largest weight: one device and several sum the rows in different orders


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(ROWS, 12, generator=generator), torch.randint(0, 3, (ROWS,), generator=generator))


def prefetching_run(strategy: str, devices: int, options: dict | None = None) -> list[torch.Tensor]:
    """EPOCHS epochs of nanoGPT's loop shape: the next batch is drawn between the forward and the backward."""
    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False, **(options or {}))
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    loader = engine.setup_dataloader(DataLoader(data(), batch_size=BATCH))
    for _ in range(EPOCHS):
        batches = iter(loader)
        x, y = next(batches)
        while x is not None:
            loss = nn.functional.cross_entropy(model(x), y)
            x, y = next(batches, (None, None))  # fetched before backward, as nanoGPT's get_batch is
            optimizer.zero_grad()
            engine.backward(loss)
            optimizer.step()
    bare = engine.model_copies()[0][0]
    weights = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in bare.parameters()]
    engine.close()
    return weights


PER_DEVICE_CASES = [
    pytest.param(name, options, id=name + "".join(f"-{k}{v}" for k, v in options.items()))
    for name in available_strategies()
    if strategy_class(name).traits.processes == PER_DEVICE and strategy_class(name).traits.sync_every == 1
    for options in ([{}, {"stage": 2}] if name == "zero" else [{}])
]


@pytest.fixture(scope="module")
def one_device() -> list[torch.Tensor]:
    return prefetching_run(reference(), 1)


def largest_relative_difference(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    scale = max(t.abs().max().item() for t in theirs)
    return max((a - b).abs().max().item() for a, b in zip(mine, theirs)) / scale


@pytest.mark.parametrize("strategy,options", PER_DEVICE_CASES)
def test_a_prefetching_loop_takes_the_single_device_steps(strategy, options, one_device, groups):
    for rank, weights in enumerate(groups(2).run(prefetching_run, strategy, 2, options)):
        difference = largest_relative_difference(weights, one_device)
        assert difference <= TOLERANCE, f"{strategy} {options}, process {rank}: weights off by {difference:.3g}"


def record(index: int, weight: float) -> BatchRecord:
    return BatchRecord(epoch=0, index=index, rows=8, global_rows=15, loss_weight=weight)


def test_the_weight_is_the_forwards_batch_not_the_batch_in_hand():
    batches, layer = ForwardBatches(), nn.Linear(3, 2)
    batches.batch_yielded(record(0, 1.0))
    loss = layer(torch.ones(4, 3)).pow(2).mean()
    batches.forward_ran(layer(torch.ones(4, 3)))  # an output the loss does not use: its own mark only
    batches.batch_yielded(record(1, 16 / 15))
    out = layer(torch.ones(4, 3))
    batches.forward_ran(out)
    assert batches.loss_weight(out.sum()) == pytest.approx(16 / 15)
    # the first loss's forward ran before the wrapper marked anything: the batch in hand, as before
    assert batches.loss_weight(loss) == pytest.approx(16 / 15)


def test_a_loss_over_batches_of_different_shares_is_refused_in_one_line():
    batches, layer = ForwardBatches(), nn.Linear(3, 2)
    batches.batch_yielded(record(4, 1.0))
    first = layer(torch.ones(4, 3))
    batches.forward_ran(first)
    batches.batch_yielded(record(5, 16 / 15))
    second = layer(torch.ones(4, 3))
    batches.forward_ran(second)
    with pytest.raises(ValueError, match=r"^loss: .*batch 4 of epoch 0.*batch 5 of epoch 0") as raised:
        batches.loss_weight(first.mean() + second.mean())
    assert "\n" not in str(raised.value)
    # forwards of one batch, or of batches with the same share, are one weight
    batches.batch_yielded(record(6, 16 / 15))
    third = layer(torch.ones(4, 3))
    batches.forward_ran(third)
    assert batches.loss_weight(second.mean() + third.mean()) == pytest.approx(16 / 15)


def test_a_forward_without_a_graph_marks_nothing():
    batches, layer = ForwardBatches(), nn.Linear(3, 2)
    batches.batch_yielded(record(0, 0.5))
    with torch.no_grad():
        batches.forward_ran(layer(torch.ones(2, 3)))
    assert not batches.marking
