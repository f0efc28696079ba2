"""Checks of command-line values, shared by the commands: each bad value is one line that names the flag,
the value and what would be accepted, raised before any work starts (main turns it into exit code 2)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

# numpy's and scikit-learn's seeds (random_state) are 32-bit unsigned
MAX_SEED = 2**32 - 1


def at_least(flag: str, value: int, minimum: int = 1) -> int:
    if value < minimum:
        raise ValueError(f"{flag}: expected at least {minimum}, got {value}")
    return value


def finite_number(flag: str, value: float, *, minimum: float = 0.0) -> float:
    """A float that is a number (not nan or inf) and at least `minimum`."""
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"{flag}: expected a finite number >= {minimum:g}, got {value!r}")
    return value


def seed(flag: str, value: int) -> int:
    if not 0 <= value <= MAX_SEED:
        raise ValueError(f"{flag}: expected a seed from 0 to {MAX_SEED} (2**32 - 1), got {value}")
    return value


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def output_directory(flag: str, path: str | os.PathLike) -> Path:
    """A folder dpkit may create or write into: not a file, and writable (or creatable in a writable folder)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag}: {str(path)!r} is a file, expected a folder (existing or to create)")
    existing = _nearest_existing(path)
    if not existing.is_dir():
        raise ValueError(f"{flag}: {str(path)!r} cannot be created: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path.absolute() else f"cannot be created: {str(existing)!r} is not writable"
        raise ValueError(f"{flag}: {str(path)!r} {what}; choose a folder you can write to")
    return path


def output_file(flag: str, path: str | os.PathLike | None) -> Path | None:
    """A file path dpkit may write: not a folder, in a folder that exists or can be created and is writable."""
    if path is None:
        return None
    path = Path(path)
    if path.is_dir() or str(path).endswith(os.sep):
        raise ValueError(f"{flag}: {str(path)!r} is a folder, expected a file name (e.g. {str(path / 'report.json')!r})")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag}: {str(path)!r} is not writable; choose a file you can write")
    output_directory(flag, path.parent)
    return path


def built_model(flag: str, factory: Callable[[], Any], name: str) -> nn.Module:
    """Call a model factory and insist on an nn.Module back."""
    try:
        model = factory()
    except Exception as error:  # the user's code: say where it came from, in one line
        raise ValueError(f"{flag}: {name}() raised {type(error).__name__}: {error}") from error
    if not isinstance(model, nn.Module):
        raise TypeError(f"{flag}: {name}() returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def classification_data(flag: str, data: Any, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test) as tensors with matching rows, class labels as 1-D integers."""
    if not isinstance(data, (tuple, list)) or len(data) != 4 or not all(isinstance(t, torch.Tensor) for t in data):
        got = type(data).__name__ if not isinstance(data, (tuple, list)) else f"{len(data)} item(s) of {', '.join(type(t).__name__ for t in data)}"
        raise TypeError(f"{flag}: {name}(seed) returned {got}; expected 4 tensors (x_train, y_train, x_test, y_test)")
    x_train, y_train, x_test, y_test = data
    for x, y, part in ((x_train, y_train, "train"), (x_test, y_test, "test")):
        if x.dim() < 1 or len(x) == 0 or y.dim() != 1 or len(x) != len(y):
            raise ValueError(f"{flag}: {name}(seed) gave x_{part} of shape {tuple(x.shape)} and y_{part} of shape {tuple(y.shape)}; "
                             "expected N rows of features and N labels (shape (N,))")
        if y.is_floating_point() or y.is_complex() or (len(y) and int(y.min()) < 0):
            raise ValueError(f"{flag}: {name}(seed) gave y_{part} of dtype {y.dtype}; expected class labels 0 … C-1 as integers")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"{flag}: {name}(seed) gave train rows of shape {tuple(x_train.shape[1:])} and test rows of shape "
                         f"{tuple(x_test.shape[1:])}; expected the same")
    return x_train, y_train, x_test, y_test


def model_fits_data(flag: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """One probe forward on two rows: the model takes the data's rows and scores every class it has."""
    probe = x[:2]
    was_training = model.training
    model.eval()  # no batch statistics updated, no dropout drawn from the generators
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            output = model(probe)
    except Exception as error:
        raise ValueError(f"{flag}: the model cannot take rows of shape {tuple(x.shape[1:])} ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''})") from error
    finally:
        model.train(was_training)
    classes = int(y.max()) + 1
    if not isinstance(output, torch.Tensor) or output.dim() != 2 or output.shape[0] != len(probe) or output.shape[1] < classes:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ValueError(f"{flag}: the model gives {shape} for {len(probe)} rows; expected ({len(probe)}, C) scores with "
                         f"C >= {classes}, the classes in the labels")
