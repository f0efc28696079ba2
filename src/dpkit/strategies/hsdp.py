"""hsdp: hybrid sharding, FSDP2 over a 2-D device mesh: shard within a group, replicate across the groups.

The processes form a mesh of (replicate, shard) = (world size / shard_size, shard_size), consecutive ranks in
one shard group: by default the processes of one node, so the gathers and reduce-scatters of every step stay
on the node's fast links and only a gradient all-reduce between the groups crosses nodes (torchtitan's HSDP,
FSDP's HYBRID_SHARD). Each process keeps 1/shard_size of the weights, gradients and optimizer state; the
groups hold the same shards. Given a 2-D mesh, `fully_shard` does the rest: backward reduce-scatters within
the group and all-reduces the shards across groups, which averages over every process, so fsdp's data rule
and loss weight make it equal one device on uneven shares, as under fsdp.

Everything else is fsdp's (units, reshard_after_forward, mixed precision, saving): the state is saved through
torch.distributed.checkpoint as DTensors, which a run on another mesh (or fsdp, or one device) reshards on load.
Like fsdp it needs nothing for parameters a step leaves without a gradient, and accepts find_unused_parameters
for scripts written for ddp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from dpkit.checks import check_int
from dpkit.strategies.base import ONE_NODE, Traits
from dpkit.strategies.fsdp import FSDP
from dpkit.strategies.mesh import mesh_shape


class HSDP(FSDP):
    name = "hsdp"
    traits = replace(FSDP.traits, shard_group=ONE_NODE)
    options = FSDP.options + ("shard_size",)

    @classmethod
    def traits_for(cls, **options: Any) -> Traits:
        traits = super().traits_for(**options)
        shard_size = options.get("shard_size")
        if shard_size is None:
            return traits
        check_int(shard_size, "shard_size", meaning="processes a shard group spans")
        return replace(traits, shard_group=shard_size)

    def __init__(
        self,
        devices: Sequence[torch.device],
        *,
        shard_size: int | None = None,
        **fsdp_options: Any,
    ):
        super().__init__(devices, **fsdp_options)  # fsdp's own options and the process group's
        self.traits = self.traits_for(reshard_after_forward=self.reshard_after_forward, shard_size=shard_size)
        # (replicate, shard), refused here when shard_size does not divide the processes, before any wrapping
        self.mesh_shape = mesh_shape(self.world_size, shard_size or min(self.local_world_size, self.world_size))

    def layout(self) -> str:
        replicas, shards = self.mesh_shape
        return f"{self.name} {replicas}x{shards} (replicate x shard)"
