"""How ddp shares out the global batches, without starting processes: each step's shares are exactly the
global batch, every sample is seen once per epoch, and the order follows (seed, epoch) in every process."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from dpkit.engine.resumable_loader import ResumableLoader
from dpkit.parallel import split_sizes
from dpkit.strategies.process_shares import ProcessShares


def sharded(loader, rank, world_size, seed):
    """What engine.setup_dataloader gives a ddp process of that rank: the loader under ddp's data rule."""
    return ResumableLoader(loader, ProcessShares(rank, world_size, seed))


def rank_views(loader_factory, world_size: int, epochs: int = 1):
    """Per rank: the list of (batch of sample ids, shares) over `epochs` epochs."""
    views = []
    for rank in range(world_size):
        loader = sharded(loader_factory(), rank, world_size, seed=5)
        batches = []
        for _ in range(epochs):
            for (ids,) in loader:
                record = loader.last_batch  # the record backward's loss weight comes from
                assert record.loss_weight == record.rows * world_size / record.global_rows
                batches.append((ids.tolist(), (record.rows, record.global_rows)))
        views.append(batches)
    return views


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shares_of_every_step_are_the_global_batch(world_size, shuffle):
    dataset = TensorDataset(torch.arange(103))
    views = rank_views(lambda: DataLoader(dataset, batch_size=10, shuffle=shuffle), world_size, epochs=2)
    steps = len(views[0])
    assert all(len(v) == steps for v in views) and steps == 2 * 11
    seen_per_epoch = [[], []]
    for step in range(steps):
        shares = [views[r][step][0] for r in range(world_size)]
        global_rows = sum(len(s) for s in shares)
        assert [len(s) for s in shares] == split_sizes(global_rows, world_size)
        for rank in range(world_size):
            assert views[rank][step][1] == (len(shares[rank]), global_rows)
        seen_per_epoch[step // 11].extend(i for s in shares for i in s)
    for seen in seen_per_epoch:  # each sample once per epoch: no duplicates, nothing dropped
        assert sorted(seen) == list(range(103))
    if shuffle:  # set_epoch: a new order each epoch
        assert seen_per_epoch[0] != seen_per_epoch[1]
    else:
        assert seen_per_epoch[0] == list(range(103))


def test_a_seeded_sampler_is_kept_and_matches_the_single_process_order():
    dataset = TensorDataset(torch.arange(40))

    def loader():
        return DataLoader(
            dataset, batch_size=8, sampler=RandomSampler(dataset, generator=torch.Generator().manual_seed(9))
        )

    single = [ids.tolist() for (ids,) in loader()]
    views = rank_views(loader, 2)
    assert [a + b for (a, _), (b, _) in zip(views[0], views[1])] == single


def test_an_unseeded_shuffle_depends_only_on_seed_and_epoch():
    dataset = TensorDataset(torch.arange(20))
    orders = []
    for global_seed in (123, 456):
        torch.manual_seed(global_seed)  # the global RNG plays no part
        loader = sharded(DataLoader(dataset, batch_size=20, shuffle=True), 0, 1, seed=1)
        orders.append([ids.tolist() for _ in range(2) for (ids,) in loader])
    assert orders[0] == orders[1]
    assert orders[0][0] != orders[0][1] and sorted(orders[0][1]) == list(range(20))


def test_a_batch_smaller_than_the_world_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match="batch size of at least the world size"):
        ProcessShares(rank=2, world_size=3, seed=0).batch_share([0, 1])


def test_a_distributed_sampler_is_refused():
    dataset = TensorDataset(torch.arange(10))
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=2, rank=0))
    with pytest.raises(ValueError, match="DistributedSampler"):
        sharded(loader, 0, 2, seed=0)
