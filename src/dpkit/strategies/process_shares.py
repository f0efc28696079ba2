"""The data rule of the strategies with a process per device, apart from the processes so it can be checked
without them:

- Data: every process iterates the same global batches (same sampler order) and loads only its own
  contiguous share, sized by dpkit.split_sizes, so the shares of one step are exactly the global batch,
  and in evaluation every sample is seen once, by one process, with no padding duplicates.
- Weighting: DDP and FSDP average per-process mean losses' gradients, which over-weights the samples of a
  smaller share. Scaling each process's loss by n_rank * world / N before the average gives
  sum(n_rank / N * grad_rank), the single-device gradient of the mean over all N samples. The Engine's
  loader records n_rank and N with each batch it yields and asks `loss_weight` for the factor, which it
  passes to backward in `scale`.

The process group (process_group.py) builds one with rank 0's seed.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

from dpkit.parallel.scatter import split_sizes


class ProcessShares:
    """Every process iterates the same global batches, in the same order, loads its contiguous share of each
    (sizes by split_sizes), and scales its mean loss by its share (`loss_weight`)."""

    def __init__(self, rank: int, world_size: int, seed: int):
        self.rank, self.world_size, self.seed = rank, world_size, seed

    def global_batches(self, loader: DataLoader) -> Iterable[list[int]] | None:
        if isinstance(loader.sampler, DistributedSampler):
            raise ValueError(
                "loader: do not pass a DistributedSampler; engine.setup_dataloader gives each process its share of "
                "every global batch itself (give the loader the global batch size)"
            )
        sampler = loader.sampler
        if (
            type(sampler) is RandomSampler
            and sampler.generator is None
            and loader.generator is None
            and not sampler.replacement
            # a map-style dataset (resumable() checked) has a length; torch's Dataset type does not say so
            and sampler.num_samples == len(loader.dataset)  # type: ignore[arg-type]
            and loader.batch_size is not None  # (a resumable loader's sampler batches by it)
        ):
            # the global RNG may differ between processes; draw the order from (seed, epoch) instead
            shuffle: DistributedSampler[int] = DistributedSampler(
                loader.dataset, num_replicas=1, rank=0, shuffle=True, seed=self.seed
            )
            return BatchSampler(shuffle, loader.batch_size, loader.drop_last)
        return loader.batch_sampler

    def batch_share(self, indices: list[int]) -> list[int]:
        sizes = split_sizes(len(indices), self.world_size)
        if sizes[self.rank] == 0:
            raise ValueError(
                f"batch_size: a global batch of {len(indices)} samples "
                f"cannot give each of {self.world_size} processes a "
                "sample; use a batch size of at least the world size, or drop_last=True"
            )
        start = sum(sizes[: self.rank])
        return indices[start : start + sizes[self.rank]]

    def loss_weight(self, rows: int, global_rows: int) -> float:
        # the gradients are averaged over processes; n_rank * world / N turns that into sum(n_rank / N * grad_rank)
        return rows * self.world_size / global_rows
