"""Checks of user-given arguments, each failing with one line that names the argument, the value and
what is accepted. Every public boundary uses these instead of writing the check by hand; the `dpkit`
command translates the argument names into its flags (cli/flags.py)."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any


def check_int(value: object, argument: str, *, minimum: int = 1, meaning: str = "") -> int:
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


def check_dim(dim: object, ndim: int | None = None, argument: str = "dim") -> int:
    """A dimension index; negative counts from the end as in torch (normalised when `ndim` is known)."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{argument}: expected an int dimension, got {dim!r} ({type(dim).__name__})")
    if ndim is None:
        return dim
    if not -ndim <= dim < ndim:
        raise ValueError(f"{argument}: {dim} is out of range for a {ndim}-dim tensor (expected {-ndim} to {ndim - 1})")
    return dim % ndim


def check_number(value: object, argument: str, *, minimum: float = 0.0, positive: bool = False) -> float:
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


def check_seed(value: object, argument: str = "seed") -> int:
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


def check_batch_split(batch_size: int, devices: int, argument: str = "batch_size") -> None:
    """A global batch that gives each of `devices` devices (or processes) at least one row per step; the same
    rule for every strategy, in one process or one per device."""
    if devices > 1 and batch_size < devices:
        raise ValueError(
            f"{argument}: {batch_size} row(s) per step cannot give each of the {devices} devices one, so a device "
            f"would sit idle; give a batch of at least {devices}, or fewer devices"
        )


def check_last_batch(batch_size: int, rows: int, devices: int, argument: str = "batch_size") -> None:
    """The last batch of a pass over `rows` rows also gives each device a row: the rule of check_batch_split for
    the batch that is left over, with a batch size near the one given that keeps it."""
    last = rows % batch_size
    if devices < 2 or last == 0 or last >= devices:
        return

    def keeps(size: int) -> bool:
        return devices <= size <= rows and (rows % size == 0 or rows % size >= devices)

    nearby = sorted(
        range(max(devices, batch_size - 64), min(rows, batch_size + 64) + 1), key=lambda s: abs(s - batch_size)
    )
    near = next((size for size in nearby if keeps(size)), None)
    raise ValueError(
        f"{argument}: {batch_size} leaves a last batch of {last} row(s) of the {rows} training rows, fewer than the "
        f"{devices} devices, so a device would sit idle in that step; give a batch size that leaves at least "
        f"{devices}" + (f", such as {near}" if near else "") + ", or fewer devices"
    )
