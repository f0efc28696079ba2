"""The lightest sharding that fits, the rule `auto` and the advisor both choose by: fewer parts of the state
sharded first, then a smaller shard group; a more sharded strategy only where nothing lighter fits, or where it is
clearly faster (SHARDING_WORTH). The traits decide, never a name nor the registry's order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from dpkit.strategies import Traits

# where a less sharded strategy fits, a more sharded one is recommended only when it is this much faster: sharding
# gathers the parameters every step and saves and loads collectively, and its edge in the model (each device
# steps only its shard of the optimizer) must outweigh what the model does not see of its per-unit hooks
SHARDING_WORTH = 1.1
Item = TypeVar("Item")


def lightest_sharding(traits: Traits, processes: int, per_node: int) -> tuple[int, int]:
    """A sort key, lightest first: how many parts of the state a strategy shards, then over how many processes
    (its shard group on `processes` in all, `per_node` on each node). `auto` and the advisor take the lightest
    sharding that fits: less sharded, less to gather and to save collectively, and more replicas to read from."""
    return len(traits.sharded_parts), traits.shard_size(processes, per_node)


def lightest_worthwhile(
    items: Sequence[Item], level: Callable[[Item], tuple[int, int]], seconds: Callable[[Item], float]
) -> list[Item]:
    """The items of the lightest sharding `level` among them, and every more sharded one that takes at most
    1/SHARDING_WORTH of the time of each lighter one: sharding only where nothing lighter fits, or where it pays."""
    if not items:
        return []
    lightest = min(level(item) for item in items)
    return [
        item
        for item in items
        if level(item) == lightest
        or all(seconds(item) * SHARDING_WORTH <= seconds(other) for other in items if level(other) < level(item))
    ]
