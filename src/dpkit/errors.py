"""The one dpkit-specific exception base, for errors a caller must be able to catch as dpkit's."""


class DpkitError(RuntimeError):
    """Base of dpkit's own errors (e.g. a distributed peer that died)."""


_EVERY_RANK = "_dpkit_said_by_every_rank"


def said_by_every_rank(error: BaseException) -> BaseException:
    """Mark `error` as raised alike in every process of a launched group (engine/together.py), so that a launched
    command says it once, on rank 0; returns it."""
    setattr(error, _EVERY_RANK, True)
    return error


def is_said_by_every_rank(error: BaseException) -> bool:
    """Whether every process of the group raised `error` alike (said_by_every_rank)."""
    return bool(getattr(error, _EVERY_RANK, False))
