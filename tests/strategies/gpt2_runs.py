"""The tiny GPT-2 of test_tiny_gpt2.py trained in every process of a launched group: the unchanged transformers
loop (`out = model(**batch); engine.backward(out.loss)`) with labels and gradient checkpointing, each process on
its rows of the batch; the whole model saved by the Engine (gathered where it is sharded)."""

from __future__ import annotations

import torch

import dpkit

STEPS = 3
ROWS = 4  # the global batch: every process takes ROWS / world_size of them


def tiny_gpt2():
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def batch_ids() -> torch.Tensor:
    return torch.randint(0, 64, (ROWS, 16), generator=torch.Generator().manual_seed(1))


def train_and_save(strategy: str, devices: int, path: str) -> None:
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = dpkit.Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False)
    model, optimizer = engine.setup(model, optimizer)
    model.train()
    share = ROWS // engine.world_size
    ids = batch_ids()[engine.rank * share : (engine.rank + 1) * share]
    for _ in range(STEPS):  # every row has as many tokens, so the mean of the processes' means is the batch's
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        optimizer.zero_grad()
        out = model(**batch)
        engine.backward(out.loss)
        optimizer.step()
    engine.save(model, path)
    engine.close()


def train_many(runs: list[tuple[str, int, str]]) -> None:
    for run in runs:
        train_and_save(*run)
