"""Walking and rebuilding nested inputs and outputs: tuples, lists, dicts, namedtuples, dataclasses.

Scatter and gather both need to visit every leaf of a nested structure with a readable path
(`args[1]`, `kwargs['mask']`, `args[0].features`) and rebuild the same structure around new leaves.
torch.utils._pytree's registry says how to open and rebuild each container it knows (tuples, lists, dicts,
namedtuples, OrderedDict, and what libraries register, such as transformers' ModelOutput) and writes the
path of each child. The recursion is dpkit's: pytree's own tree_flatten leaves a reference cycle behind on
every call (its helper closes over itself), which a per-step walk must not. Two kinds pytree would treat
as opaque leaves are opened here too, so their tensors are still split: dataclasses (registering a user's
class with pytree would change it for the whole process) and subclasses of tuple/list/dict that nobody
registered. None is a leaf. `children`/`rebuild` describe those, and gather compares replicas' outputs
level by level with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree


def is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def is_dataclass_instance(obj: object) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def children(obj: Any) -> list[tuple[str, Any]] | None:
    """(path suffix, child) pairs of a container, or None for a leaf."""
    if is_namedtuple(obj):
        return [(f".{name}", value) for name, value in zip(obj._fields, obj)]
    if isinstance(obj, (tuple, list)):
        return [(f"[{i}]", value) for i, value in enumerate(obj)]
    if isinstance(obj, dict):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if is_dataclass_instance(obj):
        return [(f".{field.name}", getattr(obj, field.name)) for field in dataclasses.fields(obj)]
    return None


def rebuild(template: Any, values: list[Any]) -> Any:
    """A container of the same kind as `template`, holding `values` in the order of children()."""
    if is_namedtuple(template):
        return type(template)(*values)
    if isinstance(template, tuple):
        return type(template)(values) if type(template) is not tuple else tuple(values)
    if isinstance(template, list):
        return type(template)(values) if type(template) is not list else list(values)
    if isinstance(template, dict):
        rebuilt = dict(zip(template.keys(), values))
        return rebuilt if type(template) is dict else type(template)(rebuilt)
    if is_dataclass_instance(template):
        fields = dataclasses.fields(template)
        init_values = {f.name: v for f, v in zip(fields, values) if f.init}
        result = dataclasses.replace(template, **init_values)
        for f, v in zip(fields, values):
            if not f.init:
                object.__setattr__(result, f.name, v)
        return result
    raise TypeError(f"not a container: {type(template).__name__}")


def _opened_here(obj: object) -> bool:
    """A container pytree does not know, which dpkit still walks into."""
    if is_dataclass_instance(obj):
        return True
    return isinstance(obj, (tuple, list, dict)) and pytree._get_node_type(obj) not in pytree.SUPPORTED_NODES


def _never(_: object) -> bool:
    return False


def _open(obj: Any) -> tuple[list[str], list[Any], Callable[[list[Any]], Any]] | None:
    """(path suffixes, children, rebuild from new children) of a container, or None for a leaf."""
    if obj is None or isinstance(obj, torch.Tensor):
        return None
    # every forward walks its inputs and outputs: the plain containers without pytree's lookups, with the
    # paths pytree.keystr gives them
    kind = type(obj)
    if kind is tuple or kind is list:
        return [f"[{i}]" for i in range(len(obj))], list(obj), kind
    if kind is dict:
        return [f"[{key!r}]" for key in obj], list(obj.values()), lambda values: dict(zip(obj, values))
    if _opened_here(obj) and (parts := children(obj)) is not None:  # (children opens what _opened_here names)
        return [suffix for suffix, _ in parts], [child for _, child in parts], lambda values: rebuild(obj, values)
    handler = pytree.SUPPORTED_NODES.get(pytree._get_node_type(obj))
    if handler is None:
        return None
    if handler.flatten_with_keys_fn is not None:
        pairs, context = handler.flatten_with_keys_fn(obj)
        suffixes, kids = [pytree.keystr((key,)) for key, _ in pairs], [child for _, child in pairs]
    else:
        kids, context = handler.flatten_fn(obj)
        suffixes = [f"[{i}]" for i in range(len(kids))]
    return suffixes, list(kids), lambda values: handler.unflatten_fn(values, context)


def leaves(obj: Any, path: str, is_leaf: Callable[[object], bool] = _never) -> Iterator[tuple[str, Any]]:
    """Every leaf with its path; `is_leaf` stops the descent early (for marker objects)."""
    opened = None if is_leaf(obj) else _open(obj)
    if opened is None:
        yield path, obj
        return
    suffixes, kids, _ = opened
    for suffix, child in zip(suffixes, kids):
        yield from leaves(child, path + suffix, is_leaf)


def map_leaves(fn: Callable[[str, Any], Any], obj: Any, path: str, is_leaf: Callable[[object], bool] = _never) -> Any:
    """The same structure with every leaf replaced by fn(path, leaf)."""
    opened = None if is_leaf(obj) else _open(obj)
    if opened is None:
        return fn(path, obj)
    suffixes, kids, rebuild_from = opened
    return rebuild_from([map_leaves(fn, child, path + suffix, is_leaf) for suffix, child in zip(suffixes, kids)])
