"""Checks of user-given arguments, each failing with one line that names the argument, the value and
what is accepted. Every public boundary uses these instead of writing the check by hand."""

from __future__ import annotations

from typing import Any


def check_int(value: Any, argument: str, *, minimum: int = 1, meaning: str = "") -> int:
    """`value` as an int of at least `minimum` (bool is not an int here), else a ValueError/TypeError.

    check_int(0, "devices", meaning="number of devices") ->
    ValueError: devices: expected a positive int (number of devices), got 0
    """
    kind = {1: "a positive int", 0: "a non-negative int"}.get(minimum, f"an int >= {minimum}")
    detail = f" ({meaning})" if meaning else ""
    if isinstance(value, bool) or not isinstance(value, int):
        # an integral tensor or numpy scalar is as good as an int
        if hasattr(value, "__index__") and not isinstance(value, bool):
            try:
                value = value.__index__()
            except TypeError:
                pass
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{argument}: expected {kind}{detail}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{argument}: expected {kind}{detail}, got {value}")
    return value


def check_int_list(values: Any, argument: str, *, length: int | None = None, minimum: int = 0,
                   meaning: str = "") -> list[int]:
    """A list of ints each at least `minimum` (and `length` of them when given)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{argument}: expected a list of ints{' (' + meaning + ')' if meaning else ''}, got {values!r}")
    items = list(values)
    if length is not None and len(items) != length:
        raise ValueError(f"{argument}: has {len(items)} entries where {length} are needed{' (' + meaning + ')' if meaning else ''}")
    return [check_int(item, f"{argument}[{i}]", minimum=minimum) for i, item in enumerate(items)]


def check_dim(dim: Any, ndim: int | None = None, argument: str = "dim") -> int:
    """A dimension index; negative counts from the end as in torch (normalised when `ndim` is known)."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{argument}: expected an int dimension, got {dim!r} ({type(dim).__name__})")
    if ndim is None:
        return dim
    if not -ndim <= dim < ndim:
        raise ValueError(f"{argument}: {dim} is out of range for a {ndim}-dim tensor (expected {-ndim} to {ndim - 1})")
    return dim % ndim
