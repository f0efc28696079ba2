"""Gradient compression, as a value: what `compress=` / `--compress` names, and which strategies take which kind.

    none          gradients cross in their own dtype (the default)
    bf16, fp16    gradients cross in 16 bits: each process's gradient rounded once, summed in float32, the average
                  rounded once (ddp, zero stage 1, replicated); fsdp, zero stage 2 and hsdp reduce-scatter in 16
                  bits (FSDP2's reduce_dtype)
    powersgd[:R]  low-rank (rank R, default 2) with error feedback and warm start, after `warmup_steps`
                  synchronized steps uncompressed; tensors where it does not pay stay whole (ddp, zero stage 1,
                  replicated: whole gradients all-reduced)

Which kinds a strategy takes follows from its traits (Traits.compressions): whole gradients exchanged among
persistent replicas take every kind; gradients reduce-scattered to their shards take the 16-bit ones; a model
re-replicated each step (dp, dp-balanced) or one device takes none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("none", "bf16", "fp16", "powersgd")
SIXTEEN_BIT = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_POWERSGD_RANK = 2
# PowerSGD starts compressing after this many synchronized steps when nothing says otherwise (torch's hook
# starts at 1,000; `dpkit train` passes 10% of its --steps)
DEFAULT_WARMUP_STEPS = 1000
# PowerSGD compresses a matrix only where its low-rank factors are at least this many times smaller (torch's
# default min_compression_rate)
MIN_COMPRESSION_RATE = 2.0
ACCEPTED = "none, bf16, fp16, powersgd or powersgd:R (R a positive int, the rank; powersgd is powersgd:2)"


@dataclass(frozen=True)
class Compression:
    """A compression: `kind` from KINDS, PowerSGD's `rank` and `warmup_steps` (synchronized steps uncompressed
    before it compresses)."""

    kind: str = "none"
    rank: int = DEFAULT_POWERSGD_RANK
    warmup_steps: int = DEFAULT_WARMUP_STEPS

    def __str__(self) -> str:
        return f"powersgd:{self.rank}" if self.kind == "powersgd" else self.kind

    @property
    def compresses(self) -> bool:
        return self.kind != "none"

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype gradients cross in (bf16, fp16), None for none and powersgd."""
        return SIXTEEN_BIT.get(self.kind)


def parse_compression(value: str | Compression | None, warmup_steps: int | None = None) -> Compression:
    """`compress=` as a Compression: "none" (or None), "bf16", "fp16", "powersgd", "powersgd:R"; ValueError naming
    the argument, the value and what is accepted. `warmup_steps`: PowerSGD's, None for the default."""
    if warmup_steps is not None and (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int)):
        raise TypeError(f"compress_warmup_steps: expected a count of steps (an int >= 0), got {warmup_steps!r}")
    if warmup_steps is not None and warmup_steps < 0:
        raise ValueError(f"compress_warmup_steps: expected a count of steps (an int >= 0), got {warmup_steps}")
    if isinstance(value, Compression):
        return value if warmup_steps is None else Compression(value.kind, value.rank, warmup_steps)
    if value is None:
        value = "none"
    if not isinstance(value, str):
        raise TypeError(f"compress: expected {ACCEPTED}, got {value!r}")
    kind, colon, rank_text = value.strip().lower().partition(":")
    warmup = DEFAULT_WARMUP_STEPS if warmup_steps is None else warmup_steps
    if kind not in KINDS or (colon and kind != "powersgd"):
        raise ValueError(f"compress: expected {ACCEPTED}, got {value!r}")
    if kind != "powersgd":
        return Compression(kind, warmup_steps=warmup)
    if not colon:
        return Compression(kind, DEFAULT_POWERSGD_RANK, warmup)
    try:
        rank = int(rank_text)
    except ValueError:
        rank = 0
    if rank < 1 or not rank_text.isdigit():
        raise ValueError(f"compress: the rank of {value!r} is not a positive int; expected {ACCEPTED}")
    return Compression(kind, rank, warmup)


def powersgd_compresses(shape: torch.Size | tuple[int, ...], rank: int) -> bool:
    """Whether PowerSGD compresses a gradient of this shape at this rank: a matrix (rows x the rest) whose factors
    are at least MIN_COMPRESSION_RATE times smaller than it; vectors and scalars stay whole."""
    if len(shape) < 2:
        return False
    rows = int(shape[0])
    columns = 1
    for size in shape[1:]:
        columns *= int(size)
    factors = (rows + columns) * min(rows, columns, rank)
    return factors * MIN_COMPRESSION_RATE < rows * columns


def compressed_bytes(shapes: list[tuple[int, ...]], compression: Compression, element_bytes: int = 4) -> int:
    """The bytes one process sends into the all-reduce of gradients of these shapes (before a collective's own
    factor) under `compression` once it compresses: 16-bit elements; PowerSGD's P and Q factors for the matrices
    it compresses and the other tensors whole."""
    numel = [int(torch.Size(shape).numel()) for shape in shapes]
    if compression.wire_dtype is not None:
        return sum(numel) * 2
    if compression.kind != "powersgd":
        return sum(numel) * element_bytes
    total = 0
    for shape, count in zip(shapes, numel):
        if powersgd_compresses(shape, compression.rank):
            rows = int(shape[0])
            columns = count // rows
            total += (rows + columns) * min(rows, columns, compression.rank) * element_bytes
        else:
            total += count * element_bytes
    return total
