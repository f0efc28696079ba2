"""The errors a checkpoint or training state raises, which a caller may catch (all are DpkitErrors)."""

from __future__ import annotations

from dpkit.errors import DpkitError


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
