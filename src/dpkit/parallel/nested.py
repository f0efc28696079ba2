"""Walking and rebuilding nested inputs and outputs: tuples, lists, dicts, namedtuples, dataclasses.

Scatter and gather both need to visit every leaf of a nested structure with a readable path
(`args[1]`, `kwargs['mask']`, `args[0].features`) and rebuild the same structure around new leaves.
torch.utils._pytree does the walking and writes the paths for the containers it knows (tuples, lists,
dicts, namedtuples, OrderedDict, and what libraries register, such as transformers' ModelOutput). Two kinds
it would treat as opaque leaves are opened here instead, so their tensors are still split: dataclasses
(registering a user's class with pytree would change it for the whole process) and subclasses of
tuple/list/dict that nobody registered. `children`/`rebuild` describe those, and gather compares replicas'
outputs level by level with them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

from torch.utils import _pytree as pytree


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


def _opened_here(obj: Any) -> bool:
    """A container pytree does not know, which dpkit still walks into."""
    if is_dataclass_instance(obj):
        return True
    return isinstance(obj, (tuple, list, dict)) and pytree._get_node_type(obj) not in pytree.SUPPORTED_NODES


def _never(_: Any) -> bool:
    return False


def leaves(obj: Any, path: str, is_leaf: Callable[[Any], bool] = _never) -> Iterator[tuple[str, Any]]:
    """Every leaf with its path; `is_leaf` stops the descent early (for marker objects). None is an empty
    container, as in pytree: it has no leaves."""

    def stop(x: Any) -> bool:
        return is_leaf(x) or _opened_here(x)

    for key_path, leaf in pytree.tree_flatten_with_path(obj, is_leaf=stop)[0]:
        leaf_path = path + pytree.keystr(key_path)
        if not is_leaf(leaf) and _opened_here(leaf):
            for suffix, child in children(leaf):
                yield from leaves(child, leaf_path + suffix, is_leaf)
        else:
            yield leaf_path, leaf


def map_leaves(fn: Callable[[str, Any], Any], obj: Any, path: str, is_leaf: Callable[[Any], bool] = _never) -> Any:
    """The same structure with every leaf replaced by fn(path, leaf)."""

    def stop(x: Any) -> bool:
        return is_leaf(x) or _opened_here(x)

    def visit(key_path: tuple, leaf: Any) -> Any:
        leaf_path = path + pytree.keystr(key_path)
        if not is_leaf(leaf) and _opened_here(leaf):
            return rebuild(leaf, [map_leaves(fn, child, leaf_path + suffix, is_leaf) for suffix, child in children(leaf)])
        return fn(leaf_path, leaf)

    return pytree.tree_map_with_path(visit, obj, is_leaf=stop)
