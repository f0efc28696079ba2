"""A per-process stream factory for `dpkit train --data stream_data:streams` (tests/recipe/test_train_streams.py):
each rank its own batches of 64 features and 10 classes (the digits model's), rank 1 fewer and smaller."""

from __future__ import annotations

import torch

TEST_ROWS = {0: 50, 1: 23}  # each rank's test rows (uneven: rank 1 runs out first)


def streams(seed: int, rank: int, world_size: int) -> tuple[list, list]:
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(200, 64, generator=generator)
    y = (x[:, :10].argmax(dim=1) + rank) % 10
    sizes = [16, 16, 16] if rank == 0 else [9, 12]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    train = [(x[a : a + n], y[a : a + n]) for a, n in zip(starts, sizes)]
    rows = TEST_ROWS.get(rank, 10)
    test = [(x[100 + a : 100 + min(a + 20, rows)], y[100 + a : 100 + min(a + 20, rows)]) for a in range(0, rows, 20)]
    return train, test
