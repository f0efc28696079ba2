"""The one dpkit-specific exception base, for errors a caller must be able to catch as dpkit's."""


class DpkitError(RuntimeError):
    """Base of dpkit's own errors (e.g. a distributed peer that died)."""
