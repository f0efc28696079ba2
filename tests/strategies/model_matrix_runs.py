"""The matrix of issue 32 as Engine runs over a loader: one function, run here (single, the single-process
strategies) or in every process of a launched group (ddp, fsdp, zero, hsdp), several cells per job."""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from dpkit.engine.engine import Engine

ROWS, BATCH, STEPS = 40, 10, 4  # 4 steps of 10 rows (5 + 5 on 2 processes; accumulate=2: 2 steps of 2 x 10)
SPARE_STEPS = [False]


class Output(OrderedDict):
    """transformers' ModelOutput in miniature: keys, attributes and indices alike."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, key):
        return list(self.values())[key] if isinstance(key, int) else super().__getitem__(key)


class TinyModel(nn.Module):
    """Computes its own mean loss from `labels` (ignore_index -100), as transformers models do."""

    def __init__(self, returns="dict", checkpointing=None, unused=False, frozen=False):
        super().__init__()
        self.embed = nn.Linear(6, 16).requires_grad_(not frozen)  # frozen: never a gradient
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(16, 4)
        self.spare = nn.Linear(16, 4) if unused else None  # a trainable parameter some steps leave unused
        self.returns, self.checkpointing, self.unused = returns, checkpointing, unused

    def forward(self, x, labels):
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            if self.checkpointing is None:
                h = h + block(h)
            else:
                h = h + checkpoint(block, h, use_reentrant=self.checkpointing == "reentrant")
        logits = self.head(h)
        if self.spare is not None and SPARE_STEPS[0]:
            logits = logits + self.spare(h)
        if self.returns == "logits":
            return logits
        loss = F.cross_entropy(logits.float(), labels)
        if self.returns == "tensor":
            return loss
        if self.returns == "tuple":
            return loss, logits
        if self.returns == "output":
            return Output(loss=loss, logits=logits)
        return {"loss": loss, "logits": logits}


CELLS = {
    "dict": {"returns": "dict"},
    "model-output": {"returns": "output"},
    "tuple": {"returns": "tuple"},
    "checkpoint": {"checkpointing": "non-reentrant"},
    "checkpoint-reentrant": {"checkpointing": "reentrant"},
    "items": {"returns": "logits"},  # engine.backward(loss_sum, items=n), accumulate 2, padding
    "unused": {"unused": True},
    "frozen": {"frozen": True},
}


def data(padded: bool) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS, 6, generator=generator)
    labels = torch.randint(0, 4, (ROWS,), generator=generator)
    if padded:  # ignored rows, unevenly spread over micro-batches and processes
        labels[torch.rand(ROWS, generator=generator) < 0.4] = -100
    return TensorDataset(x, labels)


def loss_of(out, returns):
    return {"tensor": lambda: out, "tuple": lambda: out[0], "output": lambda: out.loss}.get(
        returns, lambda: out["loss"]
    )()


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def train(strategy: str, devices: int, cell: str, precision: str = "32", options: dict | None = None) -> dict:
    """The weights after the cell's steps."""
    kwargs = CELLS[cell]
    items = cell == "items"
    engine = Engine(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        precision=precision,
        accumulate=2 if items else 1,
        progress=False,
        **(options or {}),
    )
    torch.manual_seed(0)
    model = TinyModel(**kwargs)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    loader = engine.setup_dataloader(DataLoader(data(items), batch_size=BATCH))
    outcome: dict = {}
    try:
        for step, (x, labels) in enumerate(loader):
            SPARE_STEPS[0] = step % 2 == 1
            optimizer.zero_grad()
            out = model(x, labels=labels)
            if items:
                loss_sum = F.cross_entropy(out.float(), labels, ignore_index=-100, reduction="sum")
                engine.backward(loss_sum, items=(labels != -100).sum())
            else:
                engine.backward(loss_of(out, kwargs.get("returns", "dict")))
            optimizer.step()
    except Exception as error:  # a step that stops: its line, its step, and the weights it left
        outcome = {"error": f"{type(error).__name__}: {error}", "failed_at_step": step}
    bare = engine.model_copies()[0][0]
    weights = {name: whole(p.detach()).float().cpu().clone() for name, p in bare.named_parameters()}
    return {"weights": weights, **outcome}


def initial_weights(cell: str) -> dict:
    """The weights every run of the cell starts from."""
    torch.manual_seed(0)
    return {name: p.detach().clone() for name, p in TinyModel(**CELLS[cell]).named_parameters()}


@functools.cache  # read only: one run per cell and precision for the whole session
def reference(cell: str, precision: str = "32") -> dict:
    """One device, one step per global batch (accumulated micro-batches joined), a mean over the kept labels."""
    if cell != "items":
        return train("single", 1, cell, precision)
    torch.manual_seed(0)
    model = TinyModel(**CELLS[cell])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for x, labels in DataLoader(data(True), batch_size=2 * BATCH):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            logits = model(x, labels=labels)
        F.cross_entropy(logits.float(), labels, ignore_index=-100).backward()
        optimizer.step()
    return {"weights": {name: p.detach().float().clone() for name, p in model.named_parameters()}}


def train_many(runs: list[dict]) -> list[dict]:
    """Every run's result in this process, one after another."""
    results = []
    for run in runs:
        try:
            results.append(train(**run))
        except Exception as error:  # the cell's outcome: equal, or one line naming the option
            results.append({"error": f"{type(error).__name__}: {error}".splitlines()[0]})
    return results
