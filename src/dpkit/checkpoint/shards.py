"""Sharded training state: every process writes its own shards through torch.distributed.checkpoint (DCP).

A sharded strategy (fsdp) saves the model and the optimizers as they are spread over the processes, into the
folder `shards/` of a state directory (DCP's `.metadata` and one or more `.distcp` files per process). The
state directory's other promises hold for it: it is written inside the temporary directory that is renamed
into place, and rank 0 records a SHA-256 of every shard file in `state.pt`, which load_state checks first.

DCP reshards on load (a state saved by 2 processes loads into 3), and the same folder reads back whole in
one process without a process group (`read_whole`), which is how another strategy resumes a sharded state
and how `dpkit ckpt` inspects and converts one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from dpkit.checkpoint.errors import CheckpointCorruptError
from dpkit.checkpoint.model_files import check_state_dict

# torch.distributed.checkpoint is imported by the functions that use it: a process that never reads or
# writes a sharded state (most of them) does not pay for it

SHARDS = "shards"  # the folder of a state directory holding DCP's files
# files a folder browser or a network filesystem may put into any folder: never part of a state, never an error
_IGNORED_NAMES = frozenset({".DS_Store", "Thumbs.db", "desktop.ini"})
_IGNORED_PREFIXES = ("._", ".nfs")  # macOS's AppleDouble files; NFS's renamed open files


def ignored_name(name: str) -> bool:
    """Whether a file of this name in a state directory is the operating system's, not a stray file."""
    return name in _IGNORED_NAMES or name.startswith(_IGNORED_PREFIXES)


_CHUNK_BYTES = 1 << 20


def write_shards(state: dict[str, Any], folder: Path, group: Any = None) -> None:
    """Every process writes its shards of `state` into `folder` (a collective over `group`, by default the
    default process group)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=folder, process_group=group)


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            sha.update(chunk)
    return sha.hexdigest()


def shard_digests(folder: Path) -> dict[str, str]:
    """{file name: SHA-256} of every file DCP wrote into `folder`."""
    return {path.name: _digest(path) for path in sorted(folder.iterdir()) if path.is_file()}


def verify_shards(folder: Path, digests: Mapping[str, str], *, every: Iterable[str] | None = None) -> None:
    """Raise CheckpointCorruptError naming the first shard file that is missing or whose bytes changed, or a file
    the state does not list. `every` names all of the state's shard files when `digests` holds a share of them
    (each process checks its share); by default `digests` lists them all."""
    if not folder.is_dir():
        raise CheckpointCorruptError(
            f"{folder}: the state's shards are missing (the folder is gone); restore it from a backup, or load an "
            "earlier state by passing its step directory"
        )
    listed = set(digests if every is None else every)
    present = {path.name for path in folder.iterdir()}
    missing = sorted(listed - present)
    if missing:
        raise CheckpointCorruptError(
            f"{folder / missing[0]}: a shard file of this state is missing"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "; restore it from a backup, or load an earlier state by passing its step directory"
        )
    extra = sorted(name for name in present - listed if not ignored_name(name))
    if extra:
        raise CheckpointCorruptError(
            f"{folder}: holds {', '.join(extra)}, which this state did not write (its shard files are listed with "
            "their checksums in state.pt); the folder was changed since the save: remove what you put there, or "
            "load an earlier state"
        )
    for name, expected in digests.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointCorruptError(f"{path}: a shard file of this state is not a file")
        if _digest(path) != expected:
            raise CheckpointCorruptError(f"{path}: checksum mismatch; the shard file is damaged")


def shard_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """{flattened key ("model.0.weight", "optimizers.0.state.0.weight.exp_avg", …): a meta tensor of the whole
    shape and dtype} from DCP's metadata, without reading any shard."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(folder).read_metadata()
    return {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype, device="meta")
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


def saved_model_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The model's entries of a sharded state, keyed as the bare model names them, as meta tensors."""
    prefix = "model."
    return {key[len(prefix) :]: value for key, value in shard_tensors(folder).items() if key.startswith(prefix)}


def read_whole(folder: Path) -> dict[str, Any]:
    """The whole state (every shard joined) in this process, on the CPU, without a process group."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def load_into(state: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A copy of `state` (this process's shards, as a sharded strategy holds them) filled from `folder`: the
    caller's tensors stay untouched until it applies the copy (a collective; DCP reshards to this layout)."""
    import torch.distributed.checkpoint as dcp

    copy = tree_map_only(torch.Tensor, lambda tensor: tensor.detach().clone(), state)
    dcp.load(copy, checkpoint_id=folder)
    return copy


def check_shard_shapes(model: nn.Module, folder: Path) -> None:
    """Raise CheckpointMismatchError unless the saved model's keys and whole shapes (DCP's metadata; no shard
    is read) are the model's."""
    check_state_dict(model, saved_model_tensors(folder), folder)
