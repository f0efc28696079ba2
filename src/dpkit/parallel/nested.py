"""Walking and rebuilding nested inputs and outputs: tuples, lists, dicts, namedtuples, dataclasses.

Scatter and gather both need to visit every leaf of a nested structure with a readable path
(`args[1]`, `kwargs['mask']`, `args[0].features`) and rebuild the same structure around new leaves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def is_dataclass_instance(obj: Any) -> bool:
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


def leaves(obj: Any, path: str, is_leaf: Callable[[Any], bool] = lambda _: False) -> Iterator[tuple[str, Any]]:
    """Every leaf with its path; `is_leaf` stops the descent early (for marker objects)."""
    parts = None if is_leaf(obj) else children(obj)
    if parts is None:
        yield path, obj
        return
    for suffix, child in parts:
        yield from leaves(child, path + suffix, is_leaf)


def map_leaves(fn: Callable[[str, Any], Any], obj: Any, path: str, is_leaf: Callable[[Any], bool] = lambda _: False) -> Any:
    """The same structure with every leaf replaced by fn(path, leaf)."""
    parts = None if is_leaf(obj) else children(obj)
    if parts is None:
        return fn(path, obj)
    return rebuild(obj, [map_leaves(fn, child, path + suffix, is_leaf) for suffix, child in parts])
