"""What this machine has: the accelerator, CPU cores and torch's threads, each GPU (name, memory, SMs, compute
capability, its catalogue entry) and which GPUs can access each other's memory."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from dpkit.plan.catalogue import Catalogue


def detect_accelerator(accelerator: str) -> str:
    if accelerator not in ("auto", "cpu", "cuda"):
        raise ValueError(f"accelerator: expected 'auto', 'cpu' or 'cuda', got {accelerator!r}")
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError("accelerator: 'cuda' was asked for but torch sees no CUDA GPU; use accelerator=cpu")
    return accelerator


def describe_devices(accelerator: str, catalogue: Catalogue) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    description: dict[str, Any] = {
        "cpu": {
            "processor": platform.processor() or platform.machine(),
            "cores": cores,
            "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
        },
        "cuda": [],
    }
    if accelerator == "cuda":
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            match = catalogue.match_gpu(properties.name)
            description["cuda"].append(
                {
                    "index": index,
                    "name": properties.name,
                    "memory_bytes": int(properties.total_memory),
                    "multiprocessors": properties.multi_processor_count,
                    "compute_capability": f"{properties.major}.{properties.minor}",
                    "catalogue_gpu": match.name if match else None,
                }
            )
    return description


def peer_access_matrix(device_count: int) -> list[list[bool | None]]:
    """[i][j]: whether GPU i can access GPU j's memory directly (None on the diagonal)."""
    return [
        [None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(device_count)]
        for i in range(device_count)
    ]
