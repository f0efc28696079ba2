"""The CUDA seam: device guards and streams for replica threads. Everything here is a no-op on CPU."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch


def current_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The caller's current stream on `device` (captured on the calling thread), or None on CPU."""
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    return None


def device_context(device: torch.device, stream: torch.cuda.Stream | None = None) -> AbstractContextManager:
    """Make `device` (and the caller's stream on it) current in a replica's thread."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stack.enter_context(torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(device)))
    return stack
