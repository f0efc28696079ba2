"""Checkpoints without wrapper prefixes, written atomically.

Wrappers rename a model's keys: DataParallel and DistributedDataParallel add `module.`, torch.compile
adds `_orig_mod.`. A checkpoint saved through a wrapper then fails to load into the bare model.
`save_model` always writes the bare model's keys; `load_model` accepts either form and loads into a
bare or wrapped model, and changes nothing when the keys or shapes do not match.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from dpkit.errors import DpkitError

log = logging.getLogger("dpkit")

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class CheckpointMismatchError(DpkitError):
    """The checkpoint's keys or shapes do not match the model's."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The innermost model under DataParallel, DistributedDataParallel, torch.compile and dpkit's wrappers.

    A wrapper of dpkit's own says so with a class attribute `wraps_module = True` and keeps the wrapped
    model in `.module`.
    """
    while True:
        inner = getattr(model, "module", None)
        if hasattr(model, "_orig_mod") and isinstance(getattr(model, "_orig_mod"), nn.Module):
            model = model._orig_mod
        elif isinstance(inner, nn.Module) and (
            isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel))
            or type(model).__name__ in ("DataParallel", "DistributedDataParallel")
            or getattr(type(model), "wraps_module", False)
        ):
            model = inner
        else:
            return model


def strip_prefixes(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Keys without any leading chain of wrapper prefixes ('module.', '_orig_mod.')."""
    clean = {}
    for key, value in state_dict.items():
        stripped = key
        while stripped.startswith(WRAPPER_PREFIXES):
            stripped = stripped[len("module."):] if stripped.startswith("module.") else stripped[len("_orig_mod."):]
        if stripped in clean:
            raise CheckpointMismatchError(f"state dict: keys '{key}' and another both map to '{stripped}' once wrapper prefixes are removed")
        clean[stripped] = value
    return clean


def clean_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return strip_prefixes(unwrap_model(model).state_dict())


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """torch.save to a temporary file in the same folder, fsync, then rename over `path`."""
    path = Path(path)
    if path.exists() and path.is_dir():
        raise IsADirectoryError(f"path: {path} is a directory; give a file name such as {path / 'model.pt'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return path


def save_model(model: nn.Module, path: str | os.PathLike) -> Path:
    """Save the bare model's state dict (no `module.` / `_orig_mod.` prefixes), atomically."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    state = {key: value.detach().cpu() for key, value in clean_state_dict(model).items()}
    written = atomic_save(state, path)
    log.debug("saved %d tensors to %s", len(state), written)
    return written


def load_model(model: nn.Module, path: str | os.PathLike, *, map_location: Any = "cpu") -> nn.Module:
    """Load a clean or prefixed state dict into a bare or wrapped model (weights_only=True).

    Raises CheckpointMismatchError listing the missing and unexpected keys (and shape mismatches)
    before anything is copied, so a failed load leaves the model as it was.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no checkpoint at {path}")
    loaded = torch.load(path, map_location=map_location, weights_only=True)
    if isinstance(loaded, dict) and "model" in loaded and isinstance(loaded["model"], dict):
        loaded = loaded["model"]  # a full training checkpoint
    if not isinstance(loaded, dict):
        raise CheckpointMismatchError(f"{path}: expected a state dict, found {type(loaded).__name__}")
    state = strip_prefixes(loaded)
    target = unwrap_model(model)
    # keys as the target names them, for a wrapper unwrap_model does not know
    own_keys = {clean: key for clean, key in zip(strip_prefixes(target.state_dict()), target.state_dict())}
    expected = strip_prefixes(target.state_dict())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong_shape = sorted(
        f"{key}: checkpoint {tuple(state[key].shape)} vs model {tuple(expected[key].shape)}"
        for key in set(state) & set(expected)
        if isinstance(state[key], torch.Tensor) and state[key].shape != expected[key].shape
    )
    if missing or unexpected or wrong_shape:
        lines = [f"{path} does not match {type(target).__name__}; nothing was loaded"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
        if wrong_shape:
            lines.append(f"  shape mismatches ({len(wrong_shape)}): {'; '.join(wrong_shape)}")
        raise CheckpointMismatchError("\n".join(lines))
    target.load_state_dict({own_keys[key]: value for key, value in state.items()}, strict=True)
    return model
