"""Checks every process agrees on before any of them fails: one process's refusal becomes every process's.

A check that one process alone fails (its own rank-R.pt damaged, a file only its node sees) would otherwise end
that process while the others go on into the next collective and die of a lost peer, each with its own traceback.
`agreed` runs the check in every process, gathers what each found, and when any failed, every process raises the
first failure's error (rank order): the same line everywhere, marked as said by every rank, so that a launched
command prints it once (rank 0) and every process exits with the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

from dpkit.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointRefusedError
from dpkit.errors import DpkitError, said_by_every_rank

if TYPE_CHECKING:
    from dpkit.strategies import Strategy

T = TypeVar("T")

# the errors a check raises, rebuilt from their name and message in the processes that did not meet them
_KINDS: dict[str, type[Exception]] = {
    kind.__name__: kind
    for kind in (
        ValueError,
        TypeError,
        FileNotFoundError,
        CheckpointCorruptError,
        CheckpointMismatchError,
        CheckpointRefusedError,
    )
}


def agreed(strategy: Strategy, check: Callable[[], T]) -> T:
    """`check()`'s result when it succeeded in every process of `strategy`'s group; else the first failure's
    error (by rank), raised in every process and marked said_by_every_rank. One process: check() as it is."""
    if strategy.world_size == 1:
        return check()
    failure: Exception | None = None
    try:
        result = check()
    except Exception as raised:
        failure = raised
    found = strategy.all_gather_object(None if failure is None else (type(failure).__name__, str(failure)))
    first = next(((rank, said) for rank, said in enumerate(found) if said is not None), None)
    if first is None and failure is None:
        return result
    if first is None:  # (every process gathers what each met: a failure here is in the list)
        raise said_by_every_rank(cast(Exception, failure))
    rank, (kind, message) = first
    if rank == strategy.rank and failure is not None:
        raise said_by_every_rank(failure)
    named: Exception = (
        _KINDS[kind](message) if kind in _KINDS else DpkitError(f"rank {rank} failed ({kind}: {message})")
    )  # a refusal rebuilt; else a failure of that process, which the others name
    raise said_by_every_rank(named) from None
