"""Checks of user-given arguments, each failing with one line that names the argument, the value and
what is accepted. Every public boundary uses these instead of writing the check by hand; the `dpkit`
command translates the argument names into its flags (cli/flags.py)."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
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
            with contextlib.suppress(TypeError):
                value = value.__index__()
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{argument}: expected {kind}{detail}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{argument}: expected {kind}{detail}, got {value}")
    return value


def check_int_list(
    values: Any, argument: str, *, length: int | None = None, minimum: int = 0, meaning: str = ""
) -> list[int]:
    """A list of ints each at least `minimum` (and `length` of them when given)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{argument}: expected a list of ints{' (' + meaning + ')' if meaning else ''}, got {values!r}")
    items = list(values)
    if length is not None and len(items) != length:
        raise ValueError(
            f"{argument}: has {len(items)} entries where {length} are needed{' (' + meaning + ')' if meaning else ''}"
        )
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


def check_number(value: Any, argument: str, *, minimum: float = 0.0, positive: bool = False) -> float:
    """A finite real number (not nan or inf) of at least `minimum` (above 0 with positive=True)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argument}: expected a number, got {value!r} ({type(value).__name__})")
    if positive:
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{argument}: expected a finite number > 0, got {value!r}")
    elif not math.isfinite(value) or value < minimum:
        raise ValueError(f"{argument}: expected a finite number >= {minimum:g}, got {value!r}")
    return float(value)


# numpy's and scikit-learn's seeds (random_state) are 32-bit unsigned
MAX_SEED = 2**32 - 1


def check_seed(value: Any, argument: str = "seed") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise ValueError(f"{argument}: expected a seed from 0 to {MAX_SEED} (2**32 - 1), got {value!r}")
    return value


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_folder(path: str | os.PathLike, argument: str) -> Path:
    """A folder dpkit may create or write into: not a file, and writable (or creatable in a writable folder)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{argument}: {str(path)!r} is a file, expected a folder (existing or to create)")
    existing = _nearest_existing(path)
    if not existing.is_dir():
        raise ValueError(f"{argument}: {str(path)!r} cannot be created: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = (
            "is not writable"
            if existing == path.absolute()
            else f"cannot be created: {str(existing)!r} is not writable"
        )
        raise ValueError(f"{argument}: {str(path)!r} {what}; choose a folder you can write to")
    return path


def check_output_file(path: str | os.PathLike | None, argument: str) -> Path | None:
    """A file path dpkit may write: not a folder, in a folder that exists or can be created and is writable."""
    if path is None:
        return None
    path = Path(path)
    if path.is_dir() or str(path).endswith(os.sep):
        raise ValueError(
            f"{argument}: {str(path)!r} is a folder, expected a file name (e.g. {str(path / 'report.json')!r})"
        )
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{argument}: {str(path)!r} is not writable; choose a file you can write")
    check_output_folder(path.parent, argument)
    return path
