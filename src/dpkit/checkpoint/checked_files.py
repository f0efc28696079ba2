"""Files with a checksum, written atomically: what every checkpoint and training state file is.

A file dpkit writes is an ordinary torch.save zip archive (torch.load reads it) whose zip comment holds
the SHA-256 of the archive: a flipped, truncated or replaced byte is found on load, with the path named.
Writes go to a temporary file next to the target, are fsynced and renamed over it, so a killed save
leaves the previous file; the next save removes the temporary files such kills left behind.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from dpkit.checkpoint.errors import CheckpointCorruptError, CheckpointWriteError

log = logging.getLogger("dpkit")

_CHECKSUM_TAG = b"dpkit-sha256 "
_CHECKSUM_COMMENT_BYTES = len(_CHECKSUM_TAG) + 64
_ZIP_END = b"PK\x05\x06"  # end-of-central-directory signature; its record is 22 bytes + the comment
_ZIP_END_BYTES = 22


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


def write_checked(obj: object, handle: BinaryIO) -> None:
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


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
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


def write_error(failure: OSError, path: str | os.PathLike, intact: str) -> CheckpointWriteError:
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


def atomic_save(obj: object, path: str | os.PathLike) -> Path:
    """torch.save with a checksum, to a temporary file in the same folder, fsynced, then renamed over `path`."""
    return atomic_write(path, lambda handle: write_checked(obj, handle))


def corrupt_error(path: Path, what: str) -> CheckpointCorruptError:
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
        raise corrupt_error(path, "the file is empty (0 bytes)")
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
                raise corrupt_error(path, "its zip directory is damaged")
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
                raise corrupt_error(path, "its SHA-256 checksum does not match its contents")
            return True
    if head == b"PK\x03\x04":
        if not tail.endswith(b"\x00\x00") or tail[-_ZIP_END_BYTES:][:4] != _ZIP_END:
            raise corrupt_error(path, f"the file is truncated or damaged ({size} bytes, no end of archive)")
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as error:
            raise corrupt_error(path, f"its zip archive is damaged ({error})") from error
        if bad is not None:
            raise corrupt_error(path, f"record {bad} fails its CRC-32 check")
    return False
