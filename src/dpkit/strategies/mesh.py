"""The device mesh a sharding strategy spreads its state over: 1-D (shard over every process, fsdp) or 2-D
(replicate across groups, shard within each, hsdp), from the traits' shard group. Not a strategy itself.

    mesh = shard_mesh(strategy.device.type, shard_size=strategy.traits.shard_size(world_size, per_node),
                      world_size=world_size)
    fully_shard(module, mesh=mesh)   # 1-D: FSDP; 2-D ("replicate", "shard"): HSDP
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dpkit.checks import check_int

REPLICATE, SHARD = "replicate", "shard"  # the mesh's dimension names, outermost first


def mesh_shape(world_size: int, shard_size: int) -> tuple[int, int]:
    """(replicate groups, processes per shard group) for `world_size` processes sharded over `shard_size`."""
    check_int(world_size, "world_size", meaning="processes")
    check_int(shard_size, "shard_size", meaning="processes a shard group spans")
    if shard_size > world_size or world_size % shard_size:
        raise ValueError(
            f"shard_size: {shard_size} processes per shard group do not divide the {world_size} processes of the run; "
            f"choose a divisor of {world_size}"
        )
    return world_size // shard_size, shard_size


def shard_mesh(device_type: str, world_size: int, shard_size: int | None = None) -> DeviceMesh:
    """The mesh of this run's processes: 1-D ("shard",) over all of them when `shard_size` is None or all of them,
    else 2-D ("replicate", "shard"), consecutive ranks sharing a shard group (the processes of one node, as the
    launcher numbers them). Every process calls it (it makes the mesh's process groups)."""
    replicate, shard = mesh_shape(world_size, world_size if shard_size is None else shard_size)
    if replicate == 1:
        return init_device_mesh(device_type, (shard,), mesh_dim_names=(SHARD,))
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=(REPLICATE, SHARD))
