"""The random number generators a resumed run must set back: Python's, NumPy's, torch's CPU and every CUDA one.

dpkit's per-replica generators are seeded from torch's CPU generator at each step, so capturing that one
captures them.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from dpkit.checkpoint.errors import CheckpointCorruptError

log = logging.getLogger("dpkit")


def capture_rng(*, cuda: bool = True) -> dict[str, Any]:
    """The states of Python's, NumPy's and torch's global generators (and CUDA's, when in use)."""
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        # as plain values and a tensor, so that weights_only loading reads them back
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def check_rng(state: object, source: object) -> None:
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise CheckpointCorruptError(
            f"{source}: the generator states are missing or incomplete; the state cannot be resumed exactly"
        )
    if not isinstance(state["torch"], torch.Tensor) or state["torch"].dtype != torch.uint8:
        raise CheckpointCorruptError(f"{source}: torch's generator state is not a byte tensor")


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": numpy_state["bit_generator"],
            "state": {"key": numpy_state["key"].numpy().astype(np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    saved_cuda = state.get("cuda")
    if saved_cuda and torch.cuda.is_available():
        count = min(len(saved_cuda), torch.cuda.device_count())
        if count < len(saved_cuda):
            log.warning(
                "the state holds %d CUDA generators, this process sees %d GPUs; restoring the first %d",
                len(saved_cuda),
                torch.cuda.device_count(),
                count,
            )
        for index in range(count):
            torch.cuda.set_rng_state(saved_cuda[index], index)
