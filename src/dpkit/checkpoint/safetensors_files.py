"""safetensors files with dpkit's checksum in their metadata, written atomically (`dpkit ckpt convert`)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

from dpkit.checkpoint.checked_files import atomic_write, corrupt_error

if TYPE_CHECKING:
    from torch.serialization import MAP_LOCATION as MapLocation

_SAFETENSORS_KEY = "dpkit_sha256"


def is_safetensors(path: Path) -> bool:
    if path.suffix == ".safetensors":
        return True
    try:
        with open(path, "rb") as handle:
            head = handle.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < (100 << 20)


def _safetensors_digest(header: dict, data: bytes | memoryview) -> str:
    """SHA-256 over the header (without the checksum, canonical JSON) and the tensor bytes."""
    canonical = dict(header)
    metadata = dict(canonical.get("__metadata__") or {})
    metadata.pop(_SAFETENSORS_KEY, None)
    canonical["__metadata__"] = metadata
    digest = hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode())
    digest.update(data)
    return digest.hexdigest()


def write_safetensors(
    state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> Path:
    """A safetensors file (atomic, with dpkit's checksum in its metadata) of a flat dict of tensors."""
    try:
        from safetensors.torch import save
    except ImportError as error:
        raise RuntimeError("safetensors: the safetensors package is not installed; pip install safetensors") from error
    tensors = {}
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state dict: safetensors holds tensors only; '{key}' is a {type(value).__name__}")
        tensors[key] = value.detach().cpu().contiguous()
    body = save(tensors, metadata=dict(metadata or {}))
    header_bytes = int.from_bytes(body[:8], "little")
    header = json.loads(body[8 : 8 + header_bytes])
    data = memoryview(body)[8 + header_bytes :]
    header.setdefault("__metadata__", {})[_SAFETENSORS_KEY] = _safetensors_digest(header, data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes

    def write(handle: BinaryIO) -> None:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        handle.write(data)

    return atomic_write(path, write)


def safetensors_has_checksum(path: str | os.PathLike) -> bool:
    with open(path, "rb") as handle:
        header_bytes = int.from_bytes(handle.read(8), "little")
        try:
            header = json.loads(handle.read(header_bytes))
        except (ValueError, UnicodeDecodeError):
            return False
    return _SAFETENSORS_KEY in (header.get("__metadata__") or {})


def read_safetensors(path: str | os.PathLike, *, map_location: MapLocation = "cpu") -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no checkpoint at {path}")
    body = path.read_bytes()
    if not body:
        raise corrupt_error(path, "the file is empty (0 bytes)")
    try:
        header_bytes = int.from_bytes(body[:8], "little")
        header = json.loads(body[8 : 8 + header_bytes])
    except (ValueError, UnicodeDecodeError) as error:
        raise corrupt_error(path, f"its safetensors header is damaged ({error})") from error
    expected = (header.get("__metadata__") or {}).get(_SAFETENSORS_KEY)
    if expected is not None and _safetensors_digest(header, memoryview(body)[8 + header_bytes :]) != expected:
        raise corrupt_error(path, "its SHA-256 checksum does not match its contents")
    try:
        from safetensors.torch import load
    except ImportError as error:
        raise RuntimeError(
            f"{path}: reading safetensors needs the safetensors package; pip install safetensors"
        ) from error
    try:
        tensors = load(body)
    except Exception as error:
        raise corrupt_error(path, f"safetensors cannot read it ({error})") from error
    device = torch.device(map_location) if isinstance(map_location, (str, torch.device)) else None
    return {k: v.to(device) for k, v in tensors.items()} if device is not None and device.type != "cpu" else tensors
