"""The units a sharding strategy gathers one at a time: the rule, apart from any process group.

fsdp (and every strategy built on FSDP2's `fully_shard`) shards the model unit by unit; the planner reads the
same rule to say how large the largest gathered unit is (plan/profiles.py), without importing a strategy.
Not a strategy itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

# a module with at least this many parameters of its own (not in a unit below it) is a unit of its own
DEFAULT_UNIT_PARAMETERS = 1_000_000


def shard_units(model: nn.Module, min_parameters: int = DEFAULT_UNIT_PARAMETERS) -> list[nn.Module]:
    """The modules the default rule shards as units of their own, innermost first (the root comes last,
    sharded apart from this list): every block of a ModuleList (transformer layers, residual stages) with
    everything inside it, and outside such blocks any module holding at least `min_parameters` parameters
    not already in a unit below it. A module whose parameters are also used outside it (tied embeddings) is
    never a unit: a tied weight must be gathered by one unit, so it stays with the root."""
    holders: dict[int, set[int]] = {}  # id(parameter) -> ids of the modules that register it themselves
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            holders.setdefault(id(parameter), set()).add(id(module))
    in_list = {id(child) for module in model.modules() if isinstance(module, nn.ModuleList) for child in module}
    taken: set[int] = set()
    units: list[nn.Module] = []

    def unit_if(module: nn.Module, large_enough: Callable[[int], bool]) -> bool:
        own = [p for p in module.parameters() if id(p) not in taken]
        inside = {id(m) for m in module.modules()}
        if own and large_enough(sum(p.numel() for p in own)) and not any(holders[id(p)] - inside for p in own):
            units.append(module)
            taken.update(id(p) for p in own)
            return True
        return False

    def visit(module: nn.Module) -> None:
        if module is not model and id(module) in in_list and unit_if(module, lambda count: True):
            return  # a block is one unit, whatever it holds: one gather and one reduce-scatter per block
        for child in module.children():
            visit(child)
        if module is not model:
            unit_if(module, lambda count: count >= min_parameters)

    visit(model)
    return units


def innermost_sharded(model: nn.Module, units: Iterable[nn.Module]) -> list[nn.Module]:
    """Of the modules sharded on their own (`units`, and the root `model` last), those with no other of them inside:
    the ones whose forward compiles whole. A module with a unit inside calls that unit's FSDP2 hooks, which dynamo
    does not trace (a graph break; in a loop over blocks it skips the whole forward), so its own code stays eager
    and its innermost units compile instead. A model without units below the root (an nn.Sequential of layers) is
    its own innermost unit."""
    sharded = list(dict.fromkeys([*units, model]))  # (in order, each once: a units= function may repeat one)
    ids = {id(module) for module in sharded}
    return [
        module for module in sharded if not any(id(inner) in ids for inner in module.modules() if inner is not module)
    ]


def shard_unit_sizes(model: nn.Module, min_parameters: int = DEFAULT_UNIT_PARAMETERS) -> list[int]:
    """Parameters of each unit `shard_units` makes of `model`, innermost first, the root's remainder last (when
    it has any)."""
    units = shard_units(model, min_parameters)
    sizes = [sum(p.numel() for p in unit.parameters()) for unit in units]
    taken = {id(p) for unit in units for p in unit.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in taken)
    return sizes + ([root] if root else [])
