"""Checkpoints without wrapper prefixes, written atomically, with a checksum that every load verifies.

Wrappers rename a model's keys: DataParallel and DistributedDataParallel add `module.`, torch.compile
adds `_orig_mod.`. A checkpoint saved through a wrapper then fails to load into the bare model.
`save_model` always writes the bare model's keys; `load_model` accepts either form (and the
`{'state_dict': ...}` / `{'model': ...}` containers other trainers write), loads into a bare or wrapped
model, and changes nothing unless every key, shape and value fits.

A file dpkit writes is an ordinary torch.save zip archive (torch.load reads it) whose zip comment holds
the SHA-256 of the archive: a flipped, truncated or replaced byte is found on load, with the path named.
Writes go to a temporary file next to the target, are fsynced and renamed over it, so a killed save
leaves the previous file; the next save removes the temporary files such kills left behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from dpkit.errors import DpkitError
from dpkit.parallel.data_parallel import DataParallel

log = logging.getLogger("dpkit")

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# keys other trainers keep the model's state dict under (pytorch/examples imagenet, timm, Lightning, dpkit state)
CONTAINER_KEYS = ("state_dict", "model")

_CHECKSUM_TAG = b"dpkit-sha256 "
_CHECKSUM_COMMENT_BYTES = len(_CHECKSUM_TAG) + 64
_ZIP_END = b"PK\x05\x06"  # end-of-central-directory signature; its record is 22 bytes + the comment
_ZIP_END_BYTES = 22
_SAFETENSORS_KEY = "dpkit_sha256"


class CheckpointMismatchError(DpkitError):
    """The checkpoint's keys, shapes or values do not match the model's."""


class CheckpointCorruptError(DpkitError):
    """A checkpoint file is empty, truncated, damaged or not a checkpoint at all."""


class CheckpointRefusedError(CheckpointCorruptError):
    """A checkpoint file is intact but holds a Python object that weights-only loading refuses to unpickle.

    A CheckpointCorruptError too (the file cannot be loaded as it is), for code that catches that."""


class CheckpointWriteError(DpkitError, OSError):
    """A checkpoint or training state could not be written (a full disk, a failing device); what was there
    before is intact. An OSError too, with the errno of the failure (errno.ENOSPC for a full disk)."""


# --- wrappers and prefixes --------------------------------------------------------------------------


def _compiled_module_type() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # noqa: BLE001 - torch builds without dynamo
        return None
    return OptimizedModule


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


# --- files with a checksum ----------------------------------------------------------------------------


def remove_stale_temporaries(path: Path) -> None:
    """Delete temporary files that earlier, killed saves of `path` left next to it."""
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            stale.unlink()
            log.debug("removed %s, left by an interrupted save", stale)
        except OSError:
            pass


def _create_temporary(path: Path) -> tuple[int, Path]:
    """A new temporary file next to `path`, created with the umask's permissions (mkstemp would force 0600)."""
    while True:
        candidate = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), candidate
        except FileExistsError:
            continue


def fsync_directory(directory: Path) -> None:
    """Make renames inside `directory` durable (not possible on every platform; best effort)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _HashingWriter:
    """A write-only file object that hashes what passes through (torch.save writes to any .write())."""

    def __init__(self, handle: BinaryIO):
        self.handle, self.digest = handle, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def write_checked(obj: Any, handle: BinaryIO) -> None:
    """torch.save `obj` into an open binary file, then its SHA-256 into the archive's zip comment, and fsync."""
    writer = _HashingWriter(handle)
    torch.save(obj, writer)  # type: ignore[arg-type]  # torch.save writes to any object with write() (its docs say)
    handle.flush()
    # torch ends the archive with an empty comment (length 0); the checksum covers the archive as written
    handle.seek(-2, os.SEEK_END)
    handle.write(_CHECKSUM_COMMENT_BYTES.to_bytes(2, "little"))
    handle.write(_CHECKSUM_TAG + writer.digest.hexdigest().encode("ascii"))
    handle.flush()
    os.fsync(handle.fileno())


def atomic_write(path: str | os.PathLike, write: Any) -> Path:
    """write(handle) into a temporary file next to `path`, fsync, rename over `path`, fsync the folder."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"path: {path} is a directory; give a file name such as {path / 'model.pt'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    existed = path.exists()
    fd, temporary = _create_temporary(path)
    try:
        with os.fdopen(fd, "w+b") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        failure = os_error_in(error)
        if failure is None or isinstance(error, CheckpointWriteError):
            raise
        raise write_error(failure, path, "the previous file is intact" if existed else "nothing was written") from error
    fsync_directory(path.parent)
    return path


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind `error`: itself, or one it was raised from or while handling (torch.save turns a
    failed write into a RuntimeError about stream positions, raised while handling the OSError)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        if not isinstance(current, RuntimeError):  # a TypeError (an unpicklable value) is no write failure
            return None
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def write_error(failure: OSError, path: Any, intact: str) -> CheckpointWriteError:
    """One line for a write that failed: what happened, where, and that what was there before is intact."""
    if failure.errno == errno.ENOSPC:
        what = "no space left on device"
    elif getattr(errno, "EDQUOT", None) is not None and failure.errno == errno.EDQUOT:
        what = "disk quota exceeded"
    else:
        what = failure.strerror or str(failure) or type(failure).__name__
    error = CheckpointWriteError(f"{what} while writing {path}; {intact}")
    error.errno = failure.errno
    return error


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """torch.save with a checksum, to a temporary file in the same folder, fsynced, then renamed over `path`."""
    return atomic_write(path, lambda handle: write_checked(obj, handle))


def _corrupt(path: Path, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{path}: {what}; an interrupted copy, a full disk or a storage error changed it: restore it from a backup, "
        "or load an earlier checkpoint"
    )


def verify_file(path: str | os.PathLike) -> bool:
    """Check a checkpoint file's integrity before it is read; True when it carries dpkit's checksum.

    Raises CheckpointCorruptError naming the path for an empty, truncated or damaged file. A torch file
    from elsewhere (no dpkit checksum) is checked with its zip archive's own CRC-32s.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no checkpoint at {path}")
    size = path.stat().st_size
    if size == 0:
        raise _corrupt(path, "the file is empty (0 bytes)")
    with open(path, "rb") as handle:
        head = handle.read(4)
        tail_bytes = min(size, _ZIP_END_BYTES + _CHECKSUM_COMMENT_BYTES)
        handle.seek(size - tail_bytes)
        tail = handle.read(tail_bytes)
        has_comment = size >= _ZIP_END_BYTES + _CHECKSUM_COMMENT_BYTES and tail[-_CHECKSUM_COMMENT_BYTES:].startswith(
            _CHECKSUM_TAG
        )
        if has_comment:
            end = tail[:_ZIP_END_BYTES]
            if not end.startswith(_ZIP_END) or end[-2:] != _CHECKSUM_COMMENT_BYTES.to_bytes(2, "little"):
                raise _corrupt(path, "its zip directory is damaged")
            expected = tail[-64:].decode("ascii", errors="replace")
            digest = hashlib.sha256()
            handle.seek(0)
            remaining = size - _CHECKSUM_COMMENT_BYTES - 2
            while remaining > 0:
                chunk = handle.read(min(remaining, 1 << 22))
                if not chunk:
                    break
                digest.update(chunk)
                remaining -= len(chunk)
            digest.update(b"\x00\x00")  # the empty comment's length, as the archive was hashed
            if digest.hexdigest() != expected:
                raise _corrupt(path, "its SHA-256 checksum does not match its contents")
            return True
    if head == b"PK\x03\x04":
        if not tail.endswith(b"\x00\x00") or tail[-_ZIP_END_BYTES:][:4] != _ZIP_END:
            raise _corrupt(path, f"the file is truncated or damaged ({size} bytes, no end of archive)")
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as error:
            raise _corrupt(path, f"its zip archive is damaged ({error})") from error
        if bad is not None:
            raise _corrupt(path, f"record {bad} fails its CRC-32 check")
    return False


def read_checked(path: str | os.PathLike, *, map_location: Any = "cpu") -> Any:
    """Verify a checkpoint file, then torch.load it with weights_only=True; errors name the path."""
    path = Path(path)
    if _is_safetensors(path):
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
            raise _corrupt(path, f"torch cannot read it ({detail})") from error
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


# --- safetensors ----------------------------------------------------------------------------------------


def _is_safetensors(path: Path) -> bool:
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


def read_safetensors(path: str | os.PathLike, *, map_location: Any = "cpu") -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no checkpoint at {path}")
    body = path.read_bytes()
    if not body:
        raise _corrupt(path, "the file is empty (0 bytes)")
    try:
        header_bytes = int.from_bytes(body[:8], "little")
        header = json.loads(body[8 : 8 + header_bytes])
    except (ValueError, UnicodeDecodeError) as error:
        raise _corrupt(path, f"its safetensors header is damaged ({error})") from error
    expected = (header.get("__metadata__") or {}).get(_SAFETENSORS_KEY)
    if expected is not None and _safetensors_digest(header, memoryview(body)[8 + header_bytes :]) != expected:
        raise _corrupt(path, "its SHA-256 checksum does not match its contents")
    try:
        from safetensors.torch import load
    except ImportError as error:
        raise RuntimeError(
            f"{path}: reading safetensors needs the safetensors package; pip install safetensors"
        ) from error
    try:
        tensors = load(body)
    except Exception as error:
        raise _corrupt(path, f"safetensors cannot read it ({error})") from error
    device = torch.device(map_location) if isinstance(map_location, (str, torch.device)) else None
    return {k: v.to(device) for k, v in tensors.items()} if device is not None and device.type != "cpu" else tensors


# --- models ---------------------------------------------------------------------------------------------


def detached_on_cpu(state: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value.detach().cpu() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def _refuse_sharded(model: nn.Module, call: str, what_it_does: str) -> None:
    """A sharded model (fsdp) holds only this process's shards: saving or loading it whole is a collective."""
    if any(isinstance(tensor, DTensor) for tensor in unwrap_model(model).state_dict().values()):
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


def read_model_file(path: str | os.PathLike, *, map_location: Any = "cpu") -> dict[str, Any]:
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


def load_model(model: nn.Module, path: str | os.PathLike, *, map_location: Any = "cpu") -> nn.Module:
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
