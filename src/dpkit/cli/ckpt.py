"""`dpkit ckpt`: look inside a checkpoint or training state, or convert a torch checkpoint.

dpkit ckpt inspect runs/train/model.pt       # keys, shapes, dtypes, sizes; checksum verified
dpkit ckpt inspect runs/train/state          # a training state: step, strategy, data position, …
dpkit ckpt convert ddp_checkpoint.pth model.pt [--safetensors] [--overwrite]
dpkit ckpt convert runs/train/state model.pt  # a training state's model (a sharded one joined) as one file
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dpkit.checkpoint.model_files import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    atomic_save,
    read_checked,
    safetensors_has_checksum,
    strip_prefixes,
    unpack_state_dict,
    verify_file,
    write_safetensors,
)
from dpkit.checkpoint.safetensors_files import is_safetensors
from dpkit.checkpoint.shards import read_whole, saved_model_tensors, verify_shards
from dpkit.checkpoint.state import check_state_files, read_state_directory, short_kind
from dpkit.checkpoint.steps import STATE_FILE, STATE_FORMAT, find_state
from dpkit.checks import check_output_file
from dpkit.cli.vocabulary import add_verb


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = add_verb(
        subparsers,
        "ckpt",
        "inspect a checkpoint or training state; convert a torch checkpoint",
        "Look inside a checkpoint file (.pt, .pth, .safetensors) or a training-state folder without loading a model:\n"
        "keys, shapes, dtypes and sizes, the step, strategy and data position of a state, every checksum verified\n"
        "(a sharded state's shards too). Convert a checkpoint written through a wrapper (DataParallel, DDP,\n"
        "torch.compile prefixes) into plain keys, or join a sharded state's model into one file.",
        (
            "dpkit ckpt inspect runs/train/model.pt",
            "dpkit ckpt inspect runs/train/state",
            "dpkit ckpt convert ddp_checkpoint.pth model.pt --safetensors",
            "dpkit ckpt convert runs/train/state model.pt    # a training state's model, shards joined",
        ),
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    inspect = actions.add_parser(
        "inspect", help="print keys, shapes, dtypes, sizes, step and strategy; verify checksums"
    )
    inspect.add_argument("path", help="a checkpoint file (.pt, .pth, .safetensors) or a training-state folder")
    convert = actions.add_parser(
        "convert",
        help="strip DataParallel/DDP/compile prefixes, or join a sharded state's model; write a .pt or safetensors",
    )
    convert.add_argument(
        "source",
        help="a torch checkpoint (a state dict, or a {'state_dict': ...} / {'model': ...} container), or a "
        "training-state folder (its model, shards joined)",
    )
    convert.add_argument("out", help="the file to write")
    convert.add_argument("--safetensors", action="store_true", help="write safetensors instead of a torch file")
    convert.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (refused otherwise)")
    return parser


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _tensor_table(state: Mapping[str, Any]) -> list[str]:
    rows = [
        (
            key,
            "x".join(map(str, value.shape)) or "scalar",
            str(value.dtype).replace("torch.", ""),
            _bytes(value.numel() * value.element_size()),
        )
        if isinstance(value, torch.Tensor)
        else (key, "-", type(value).__name__, "-")
        for key, value in state.items()
    ]
    widths = [max(len(row[i]) for row in rows + [("key", "shape", "dtype", "size")]) for i in range(4)]
    lines = [
        ("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths))).rstrip()
        for row in [("key", "shape", "dtype", "size")] + rows
    ]
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    lines.append(
        f"  {len(tensors)} tensors, {sum(t.numel() for t in tensors):,} values, "
        f"{_bytes(sum(t.numel() * t.element_size() for t in tensors))}"
    )
    return lines


def _integrity(path: Path) -> str:
    if is_safetensors(path):
        return (
            "safetensors, dpkit SHA-256 verified"
            if safetensors_has_checksum(path)
            else "safetensors without a dpkit checksum"
        )
    return (
        "dpkit SHA-256 verified"
        if verify_file(path)
        else "no dpkit checksum (a torch file from elsewhere); zip CRC-32s verified"
    )


def _describe_state(shared: dict, folder: Path | None) -> list[str]:
    strategy = shared.get("layout") or shared.get("strategy")  # (states saved before the layout was recorded)
    lines = [
        f"training state: step {shared.get('step')}, strategy {strategy} on {shared.get('world_size')} "
        f"process(es) ({', '.join(shared.get('devices', []))}), precision {shared.get('precision')}, "
        f"accumulate {shared.get('accumulate')}"
    ]
    if folder is not None:
        files = sorted(p for p in folder.iterdir() if p.is_file())
        lines.append("files: " + ", ".join(f"{p.name} {_bytes(p.stat().st_size)} ({_integrity(p)})" for p in files))
    shards = folder / shared["shards"] if folder is not None and shared.get("shards") else None
    if shards is not None:
        digests = shared.get("shard_digests") or {}
        verify_shards(shards, digests)
        size = sum((shards / name).stat().st_size for name in digests)
        lines.append(
            f"shards: {shared['shards']}/ written by {shared.get('world_size')} process(es), {len(digests)} files, "
            f"{_bytes(size)} (dpkit SHA-256 verified); the model and optimizers are in them"
        )
        for index, groups in enumerate(shared.get("optimizer_groups", [])):
            lines.append(
                f"optimizer {index}: param groups of {', '.join(map(str, groups))} parameter(s), in the shards"
            )
    for index, optimizer in enumerate(shared.get("optimizers") or []):
        groups = optimizer.get("param_groups", [])
        lrs = ", ".join(f"{g.get('lr')}" for g in groups)
        lines.append(
            f"optimizer {index}: {len(groups)} param group(s), lr {lrs}, "
            f"state for {len(optimizer.get('state', {}))} parameter(s)"
        )
    if shared.get("scaler"):
        lines.append(f"grad scaler: scale {shared['scaler'].get('scale')}")
    for index, position in enumerate(shared.get("loaders") or []):
        lines.append(
            f"loader {index}: epoch {position.get('epoch')}, "
            f"next batch {position.get('next_batch')} of {position.get('batches_per_epoch')}"
        )
    extras = shared.get("extra") or {}
    if extras:
        lines.append(
            "extras: "
            + ", ".join(
                f"{k} ({v.get('kind', '?').replace('_', ' ')}"
                + (f", a {short_kind(v['class'])}" if v.get("class") else "")
                + ")"
                for k, v in extras.items()
            )
        )
    lines.append("model:" + (" (whole shapes, from the shards' metadata)" if shards is not None else ""))
    lines += _tensor_table(saved_model_tensors(shards) if shards is not None else shared.get("model") or {})
    return lines


def _warn(message: str) -> None:
    print(f"dpkit ckpt inspect: warning: {message}", file=sys.stderr)


def _unknown_format(loaded: object) -> str | None:
    """The 'format' a file declares when it is not the one this dpkit writes (None: no format, or ours)."""
    found = loaded.get("format") if isinstance(loaded, Mapping) else None
    return None if found is None or found == STATE_FORMAT else str(found)


def _print_state(shared: dict, folder: Path | None, unknown: str | None) -> None:
    try:
        print("\n".join(_describe_state(shared, folder)))
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        if unknown is None:
            raise
        print(f"(the rest is laid out in a way this dpkit does not know: {type(error).__name__} {error})")


def inspect(path: Path) -> int:
    if path.is_dir():
        folder = find_state(path)
        if not (folder / STATE_FILE).is_file():
            raise CheckpointCorruptError(
                f"{folder / STATE_FILE}: missing, so {folder} is not a complete state; restore it from a backup, or "
                "inspect an earlier state by passing its step directory"
            )
        shared = read_checked(folder / STATE_FILE)
        unknown = _unknown_format(shared) if isinstance(shared, Mapping) else type(shared).__name__
        if unknown is not None:
            _warn(
                f"{folder / STATE_FILE}: format {unknown!r}, not the {STATE_FORMAT!r} this dpkit writes and reads; "
                "what follows may be incomplete, and engine.load_state refuses it"
            )
        else:
            check_state_files(folder, shared)
        print(f"{folder}")
        _print_state(shared if isinstance(shared, dict) else {}, folder, unknown)
        return 0
    integrity = _integrity(path)
    loaded = read_checked(path)
    print(f"{path}: {_bytes(path.stat().st_size)}, {integrity}")
    unknown = _unknown_format(loaded)
    if unknown is not None:
        _warn(
            f"{path}: format {unknown!r} is not one this dpkit knows (it writes training states in "
            f"{STATE_FORMAT!r}); what follows may be incomplete"
        )
    if isinstance(loaded, dict) and str(loaded.get("format", "")).startswith(STATE_FORMAT.split("/")[0] + "/"):
        _print_state(loaded, None, unknown)
        return 0
    state = unpack_state_dict(loaded, path)
    if isinstance(loaded, dict) and state is not loaded and set(loaded) - set(state):
        others = [k for k in loaded if not isinstance(loaded[k], torch.Tensor) and loaded.get(k) is not state]
        print(f"container entries: {', '.join(map(str, others))}")
    print("\n".join(_tensor_table(state)))
    return 0


def _model_of_state(path: Path) -> dict[str, Any]:
    """The whole model of a training state (the latest in a folder, or a step directory), its shards joined."""
    folder, shared, _ = read_state_directory(path, 0)  # every file there, in the format this dpkit reads
    if not shared.get("shards"):
        return shared.get("model") or {}
    verify_shards(folder / shared["shards"], shared.get("shard_digests") or {})
    return read_whole(folder / shared["shards"]).get("model", {})


def convert(source: Path, out: Path, to_safetensors: bool, overwrite: bool = False) -> int:
    if out.is_dir():
        raise ValueError(
            f"OUT: {out} is a directory; give a file name such as "
            f"{out / ('model.safetensors' if to_safetensors else 'model.pt')}"
        )
    if out.resolve() == source.resolve():
        raise ValueError(f"OUT: {out} is the source file; write the converted checkpoint to another file")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise ValueError(f"OUT: {out} exists; give --overwrite to replace it, or another file name")
    check_output_file(out, "OUT")  # a folder it cannot write into, before the source is read
    state = _model_of_state(source) if source.is_dir() else unpack_state_dict(read_checked(source), source)
    clean = strip_prefixes(state)
    removed = len(set(state) - set(clean))
    if not clean:
        raise CheckpointMismatchError(f"SOURCE: {source} holds no tensors to convert")
    if to_safetensors:
        skipped = [k for k, v in clean.items() if not isinstance(v, torch.Tensor)]
        if skipped:
            print(
                f"dpkit ckpt convert: left out {len(skipped)} non-tensor entries "
                f"safetensors cannot hold: {', '.join(skipped)}",
                file=sys.stderr,
            )
        written = write_safetensors(
            {k: v for k, v in clean.items() if isinstance(v, torch.Tensor)}, out, {"converted_by": "dpkit"}
        )
    else:
        written = atomic_save(dict(clean), out)
    print(
        f"wrote {written} ({_bytes(written.stat().st_size)}): {len(clean)} entries, "
        f"wrapper prefixes removed from {removed}"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "inspect":
        return inspect(Path(args.path))
    return convert(Path(args.source), Path(args.out), args.safetensors, args.overwrite)
