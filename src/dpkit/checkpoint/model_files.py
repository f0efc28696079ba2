"""Checkpoints without wrapper prefixes, written atomically, with a checksum that every load verifies.

Wrappers rename a model's keys: DataParallel and DistributedDataParallel add `module.`, torch.compile
adds `_orig_mod.`. A checkpoint saved through a wrapper then fails to load into the bare model.
`save_model` always writes the bare model's keys; `load_model` accepts either form (and the
`{'state_dict': ...}` / `{'model': ...}` containers other trainers write), loads into a bare or wrapped
model, and changes nothing unless every key, shape and value fits.


Files are checked (checkpoint/checked_files.py: a SHA-256 in every file dpkit writes, atomic writes) and read
with torch.load(weights_only=True) here; safetensors files in checkpoint/safetensors_files.py.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

# the names other modules import from here (files, safetensors and errors have rooms of their own)
from dpkit.checkpoint.checked_files import (  # noqa: F401
    _HashingWriter,
    atomic_save,
    atomic_write,
    corrupt_error,
    fsync_directory,
    os_error_in,
    remove_stale_temporaries,
    verify_file,
    write_checked,
    write_error,
)
from dpkit.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointRefusedError,
    CheckpointWriteError,
)
from dpkit.checkpoint.safetensors_files import (  # noqa: F401
    is_safetensors,
    read_safetensors,
    safetensors_has_checksum,
    write_safetensors,
)
from dpkit.parallel.data_parallel import DataParallel

if TYPE_CHECKING:
    from torch.serialization import MAP_LOCATION as MapLocation

log = logging.getLogger("dpkit")

_is_safetensors = is_safetensors  # the name dpkit.cli.ckpt imports

__all__ = [
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointRefusedError",
    "CheckpointWriteError",
    "atomic_save",
    "atomic_write",
    "check_state_dict",
    "clean_state_dict",
    "load_model",
    "read_checked",
    "read_model_file",
    "save_model",
    "save_state_dict",
    "strip_prefixes",
    "unpack_state_dict",
    "unwrap_model",
    "verify_file",
    "write_checked",
]

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# keys other trainers keep the model's state dict under (pytorch/examples imagenet, timm, Lightning, dpkit state)
CONTAINER_KEYS = ("state_dict", "model")


# --- wrappers and prefixes --------------------------------------------------------------------------


def _compiled_module_type() -> type | None:
    """torch.compile's wrapper class; None before torch._dynamo is imported (torch.compile imports it, so no
    compiled module exists before), which spares every other process importing it (over a second of CPU)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The innermost model under DataParallel, DistributedDataParallel, torch.compile and dpkit's wrappers.

    A wrapper of dpkit's own says so with a class attribute `wraps_module = True` and keeps the wrapped
    model in `.module`.
    """
    compiled = _compiled_module_type()
    wrappers = (nn.DataParallel, nn.parallel.DistributedDataParallel, DataParallel)
    while True:
        if compiled is not None and isinstance(model, compiled):
            model = model._orig_mod  # type: ignore[assignment]  # torch types a module's attributes as Tensor | Module
        elif isinstance(model, wrappers) or getattr(type(model), "wraps_module", False):
            inner = getattr(model, "module", None)
            if not isinstance(inner, nn.Module):
                return model
            model = inner
        else:
            return model


def strip_prefixes(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `state_dict` whose keys lose every leading wrapper prefix ('module.', '_orig_mod.', in any chain).

    Uses torch's consume_prefix_in_state_dict_if_present, one prefix at a time, after checking that no
    two keys would become one.
    """
    clean = OrderedDict(state_dict)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        clean._metadata = OrderedDict(metadata)  # type: ignore[attr-defined]
    while True:
        prefix = next((p for p in WRAPPER_PREFIXES if any(key.startswith(p) for key in clean)), None)
        if prefix is None:
            return clean
        plain = {key for key in clean if not key.startswith(prefix)}
        for key in clean:
            if key.startswith(prefix) and key[len(prefix) :] in plain:
                raise CheckpointMismatchError(
                    f"state dict: keys '{key}' and '{key[len(prefix) :]}' "
                    f"both map to '{key[len(prefix) :]}' once wrapper "
                    "prefixes are removed; save the model without mixing wrapped and bare keys"
                )
        consume_prefix_in_state_dict_if_present(clean, prefix)


def clean_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return strip_prefixes(unwrap_model(model).state_dict())


# --- reading ------------------------------------------------------------------------------------------


def read_checked(path: str | os.PathLike, *, map_location: MapLocation = "cpu") -> Any:
    """Verify a checkpoint file, then torch.load it with weights_only=True; errors name the path."""
    path = Path(path)
    if is_safetensors(path):
        return read_safetensors(path, map_location=map_location)
    checked = verify_file(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:
        text = str(error)
        if "Weights only load failed" in text:  # the bytes are fine: torch refuses what they hold
            raise refused_error(path, text, checked) from error
        unpickler = text.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
        detail = unpickler[0].strip() if unpickler and unpickler[0].strip() else type(error).__name__
        if checked:
            raise corrupt_error(path, f"torch cannot read it ({detail})") from error
        raise CheckpointCorruptError(
            f"{path}: not a PyTorch checkpoint (torch cannot read it: {detail}); "
            "give a file written by torch.save or dpkit"
        ) from error


_TRUST = "and save its state dict (or the plain values you need) to load it here"


def refused_error(path: Path, text: str, checked: bool) -> CheckpointRefusedError:
    """What torch.load(weights_only=True) refused, said as what it is: an object in an intact file, not damage."""
    intact = "the file is not damaged (its checksum verified)" if checked else "this is no sign of damage"
    blocked = re.search(r"GLOBAL (\S+) whose module (\S+) is blocked", text)
    if blocked:
        return CheckpointRefusedError(
            f"{path}: holds a Python object ({blocked.group(1)}) that weights-only loading never allows: module "
            f"{blocked.group(2)} could run code while the file loads ({intact}). Only if you trust "
            f"the file, load it with torch.load(path, weights_only=False) {_TRUST}"
        )
    name = re.search(r"GLOBAL (\S+) was not an allowed global", text)
    if name:
        return CheckpointRefusedError(
            f"{path}: holds a Python object ({name.group(1)}) that weights-only loading refuses (dpkit reads every "
            f"file with torch.load(weights_only=True)); {intact}. If you trust the file, allow it "
            f"with torch.serialization.add_safe_globals([{name.group(1)}]) before loading, or load it with "
            f"torch.load(path, weights_only=False) {_TRUST}"
        )
    found = re.search(r"(Can only [^\n]*|Trying to [^\n]*|Unsupported [^\n]*|[^\n]*must be imported[^\n]*)", text)
    detail = found.group(1).strip() if found else "an object it does not know"
    return CheckpointRefusedError(
        f"{path}: holds something weights-only loading refuses ({detail}); {intact}. If you trust "
        "the file, allow its classes with torch.serialization.add_safe_globals([...]) before loading, or load it "
        f"with torch.load(path, weights_only=False) {_TRUST}"
    )


# --- models ---------------------------------------------------------------------------------------------


def detached_on_cpu(state: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value.detach().cpu() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def _refuse_sharded(model: nn.Module, call: str, what_it_does: str) -> None:
    """A sharded model (fsdp) holds only this process's shards: saving or loading it whole is a collective."""
    tensor_module = sys.modules.get("torch.distributed.tensor")  # not imported: no tensor can be a DTensor
    if tensor_module is None:
        return
    if any(isinstance(tensor, tensor_module.DTensor) for tensor in unwrap_model(model).state_dict().values()):
        raise ValueError(
            "model: its parameters are sharded across processes (strategy 'fsdp') and this process holds only "
            f"its shards; call {call} in every process instead ({what_it_does})"
        )


def save_model(model: nn.Module, path: str | os.PathLike) -> Path:
    """Save the bare model's state dict (no `module.` / `_orig_mod.` prefixes), atomically, with a checksum."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    _refuse_sharded(model, "engine.save(model, path)", "it gathers the whole state dict and rank 0 writes it")
    return save_state_dict(unwrap_model(model).state_dict(), path)


def save_state_dict(state: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Save a model's state dict without wrapper prefixes, on the CPU, atomically, with a checksum."""
    state = detached_on_cpu(strip_prefixes(state))
    written = atomic_save(state, path)
    log.debug("saved %d tensors to %s", len(state), written)
    return written


def read_model_file(path: str | os.PathLike, *, map_location: MapLocation = "cpu") -> dict[str, Any]:
    """The model state dict a checkpoint file holds (its checksum verified, read with weights_only=True),
    unpacked from a trainer's {'state_dict': ...} / {'model': ...} container."""
    path = Path(path)
    return unpack_state_dict(read_checked(path, map_location=map_location), path)


def unpack_state_dict(loaded: Any, source: Any) -> dict[str, Any]:
    """The model state dict inside what a checkpoint file holds: the dict itself, or a trainer's container."""
    if not isinstance(loaded, Mapping):
        raise CheckpointMismatchError(f"{source}: expected a state dict, found {type(loaded).__name__}")
    if loaded and all(isinstance(v, torch.Tensor) for v in loaded.values()):
        return dict(loaded)
    for key in CONTAINER_KEYS:
        inner = loaded.get(key)
        if isinstance(inner, Mapping) and inner and all(isinstance(k, str) for k in inner):
            log.info("%s: loading the model's state dict from the checkpoint's %r entry", source, key)
            return dict(inner)
    return dict(loaded)


def check_state_dict(target: nn.Module, state: Mapping[str, Any], source: Any) -> dict[str, Any]:
    """The checkpoint's entries keyed as `target` names them, after checking every key, type and shape.

    Raises CheckpointMismatchError listing every problem; nothing is changed here.
    """
    state = strip_prefixes(state)
    own = target.state_dict()
    own_keys = dict(
        zip(strip_prefixes(own), own)
    )  # clean name -> the target's name (a wrapper unwrap_model does not know)
    expected = strip_prefixes(own)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong_type, wrong_shape = [], []
    for key in sorted(set(state) & set(expected)):
        mine, theirs = expected[key], state[key]
        if isinstance(mine, torch.Tensor):
            if not isinstance(theirs, torch.Tensor):
                wrong_type.append(f"{key}: checkpoint holds a {type(theirs).__name__}, the model a tensor")
            elif theirs.shape != mine.shape:
                wrong_shape.append(f"{key}: checkpoint {tuple(theirs.shape)} vs model {tuple(mine.shape)}")
    if missing or unexpected or wrong_type or wrong_shape:
        lines = [f"{source} does not match {type(target).__name__}; nothing was loaded"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
        if wrong_type:
            lines.append(f"  not tensors ({len(wrong_type)}): {'; '.join(wrong_type)}")
        if wrong_shape:
            lines.append(f"  shape mismatches ({len(wrong_shape)}): {'; '.join(wrong_shape)}")
        raise CheckpointMismatchError("\n".join(lines))
    return {own_keys[key]: value for key, value in state.items()}


def load_model(model: nn.Module, path: str | os.PathLike, *, map_location: MapLocation = "cpu") -> nn.Module:
    """Load a clean or prefixed state dict, or a trainer's {'state_dict': ...} / {'model': ...} container,
    into a bare or wrapped model. The file's checksum is verified and it is read with weights_only=True.

    Raises CheckpointMismatchError listing the missing and unexpected keys, non-tensor values and shape
    mismatches before anything is copied, so a failed load leaves the model as it was.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    _refuse_sharded(model, "engine.load(path)", "each process takes its shards of the file")
    state = read_model_file(path, map_location=map_location)
    # a wrapper that loads every copy it trains (the Engine's model) takes the state itself
    target = model if getattr(type(model), "loads_every_copy", False) else unwrap_model(model)
    target.load_state_dict(check_state_dict(target, state, path), strict=True)
    return model
