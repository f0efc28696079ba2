"""What a port from torchrun + DDP used to learn by trial, said once at run time where the run can tell: a model that
computes its own loss under a loss-in-replicas strategy, and a process's own loss printed under ddp."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpkit
from dpkit.strategies import IN_REPLICAS, ON_ROOT, matching

OWN_LOSS = "returned a loss it computed itself"
PRINTED_LOSS = "engine.print: the loss printed is this process's"


class OwnLoss(nn.Module):
    """nanoGPT's habit: the logits, and with targets the loss as well."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 32)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.head(x)
        return logits if targets is None else (logits, F.cross_entropy(logits, targets))


def steps(strategy: str, *, criterion: bool, returns_loss: bool, count: int = 2) -> None:
    engine = dpkit.Engine(strategy=strategy, accelerator="cpu", devices=2, progress=False)
    model = OwnLoss()
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss_fn = engine.setup_criterion(nn.CrossEntropyLoss()) if criterion else None
    x, y = torch.randn(16, 8), torch.randint(0, 32, (16,))
    for _ in range(count):
        optimizer.zero_grad()
        if returns_loss:
            _, loss = model(x, y)
        else:
            loss = loss_fn(model(x), y) if loss_fn else F.cross_entropy(model(x), y)
        engine.backward(loss)
        optimizer.step()
    with torch.no_grad():
        model.eval()
        model(x, y)  # evaluation: nothing to say
    engine.close()


@pytest.mark.parametrize("criterion", [False, True], ids=["no criterion", "a criterion, its output unused"])
def test_a_model_that_returns_its_own_loss_under_replicated_is_told_once(caplog, criterion):
    with caplog.at_level(logging.WARNING, logger="dpkit"):
        steps("replicated", criterion=criterion, returns_loss=True, count=3)
    said = [r.getMessage() for r in caplog.records if OWN_LOSS in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith(f"model(x) {OWN_LOSS} under strategy 'replicated': its other outputs (2.0 KiB this step")
    assert "engine.setup_criterion(loss_fn)" in said[0] and "docs/from-torchrun.md" in said[0]


@pytest.mark.parametrize(
    ("strategy", "criterion", "returns_loss"),
    [
        ("replicated", True, False),  # the port done: logits, and the criterion runs in the replicas
        (matching(lambda t: t.loss == IN_REPLICAS)[0], True, False),  # dp-balanced
        (matching(lambda t: t.loss == ON_ROOT and t.max_devices is None and t.processes == "one")[0], False, True),
    ],
)
def test_nothing_is_said_where_the_loss_already_runs_where_it_should(caplog, strategy, criterion, returns_loss):
    with caplog.at_level(logging.WARNING, logger="dpkit"):
        steps(strategy, criterion=criterion, returns_loss=returns_loss)
    assert not [r for r in caplog.records if OWN_LOSS in r.getMessage()]


# --- the loss printed under ddp -----------------------------------------------------------------------------------
class Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def printing_run() -> dict[str, list[str]]:
    """In each process of a launched group: two ddp steps, printing other numbers, then the loss three ways."""
    said = Said()
    logging.getLogger("dpkit").addHandler(said)
    heard: dict[str, list[str]] = {}
    try:
        engine = dpkit.Engine(strategy="ddp", accelerator="cpu", devices=2, progress=False)
        torch.manual_seed(0)  # the same weights and data in every process: each rank's share differs from the other's
        model = nn.Linear(8, 3)
        model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        data = TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
        for x, y in engine.setup_dataloader(DataLoader(data, batch_size=16)):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            engine.backward(loss)
            optimizer.step()
        for name, args in [
            ("other numbers", ("step", 2, "lr 0.1000", 0.25)),
            ("the global batch's", (f"loss {engine.reduce(loss, 'mean', weight=len(y)).item():.4f}",)),
            ("a formatted loss", (f"iter 2: loss {loss.item():.4f}, time 3.21ms",)),
            ("the tensor", ("loss", loss)),
        ]:
            before = len(said.messages)
            engine.print(*args)
            heard[name] = said.messages[before:]
        engine.close()
    finally:
        logging.getLogger("dpkit").removeHandler(said)
    return heard


def test_the_loss_printed_under_ddp_is_said_once_to_be_the_processs_own(groups):
    rank0, rank1 = groups(2).run(printing_run)
    assert rank0["other numbers"] == [] and rank0["the global batch's"] == []
    assert len(rank0["a formatted loss"]) == 1 and rank0["the tensor"] == []  # once
    said = rank0["a formatted loss"][0]
    assert said.startswith(f"{PRINTED_LOSS} under strategy 'ddp', the mean over its share of the batch (rank 0 of 2)")
    assert "engine.reduce(loss, 'mean', weight=len(y))" in said
    assert all(not messages for messages in rank1.values())  # rank 0 prints, and says it
