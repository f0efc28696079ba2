"""Copy bandwidth: on CUDA, host<->device (pinned and pageable host memory), within each GPU and between each
pair of GPUs; on CPU, a plain memory copy (what moving a tensor between virtual CPU devices costs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from dpkit.plan.catalogue import GPU, Link
from dpkit.tools.doctor.comparison import Comparison, link_comparison


def _seconds_per_call(function: Callable[[], object], repeats: int, synchronize: Callable[[], None]) -> float:
    function()  # warm-up: first-touch page faults, lazy CUDA initialisation
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    synchronize()
    return (time.perf_counter() - start) / repeats


def _copy_row(
    kind: str,
    source: str,
    destination: str,
    size_bytes: int,
    seconds: float,
    comparison: Comparison,
    memory: str | None = None,
) -> dict[str, Any]:
    measured = size_bytes / seconds
    row = {
        "kind": kind,
        "source": source,
        "destination": destination,
        "memory": memory,
        "size_bytes": size_bytes,
        "seconds": seconds,
        "bytes_per_second": measured,
    }
    row.update(comparison.fields(measured, judge=memory != "pageable"))
    row["note"] = comparison.note
    return row


def measure_cpu_copy(size_bytes: int, repeats: int) -> list[dict[str, Any]]:
    """A plain memory copy: what handing a tensor from one virtual CPU device to another costs."""
    source = torch.ones(size_bytes // 4, dtype=torch.float32)
    destination = torch.empty_like(source)
    seconds = _seconds_per_call(lambda: destination.copy_(source), repeats, lambda: None)
    comparison = Comparison(
        note="no catalogue figure for host memory: virtual CPU devices share it; a copy reads and writes each byte"
    )
    return [_copy_row("memory_copy", "cpu:0", "cpu:1", source.numel() * 4, seconds, comparison)]


def measure_cuda_copies(
    size_bytes: int,
    repeats: int,
    host_links: dict[int, tuple[Link | None, bool]],
    peer_link: tuple[Link | None, bool],
    gpus: dict[int, GPU | None],
    peer_access: list[list[bool | None]],
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Every GPU's copies from and to the host and within itself, then a copy between each pair of GPUs."""
    rows = []
    elements = size_bytes // 4
    for index in range(torch.cuda.device_count()):
        rows += _copies_of_one_gpu(
            index, elements, repeats, link_comparison(*host_links[index]), gpus.get(index), progress
        )
    rows += _copies_between_gpus(elements, repeats, link_comparison(*peer_link), peer_access, progress)
    return rows


def _copies_of_one_gpu(
    index: int,
    elements: int,
    repeats: int,
    host_comparison: Comparison,
    gpu: GPU | None,
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Host->device and device->host from pinned and from pageable host memory, then a copy within the GPU."""
    rows = []
    size_bytes = elements * 4
    device = torch.device("cuda", index)
    sync = lambda device=device: torch.cuda.synchronize(device)
    on_device = torch.ones(elements, dtype=torch.float32, device=device)
    for memory in ("pinned", "pageable"):
        host = torch.ones(elements, dtype=torch.float32, pin_memory=(memory == "pinned"))
        non_blocking = memory == "pinned"
        seconds = _seconds_per_call(partial(on_device.copy_, host, non_blocking=non_blocking), repeats, sync)
        rows.append(_copy_row("host_to_device", "host", str(device), size_bytes, seconds, host_comparison, memory))
        progress(f"host->{device} {memory}")
        seconds = _seconds_per_call(partial(host.copy_, on_device, non_blocking=non_blocking), repeats, sync)
        rows.append(_copy_row("device_to_host", str(device), "host", size_bytes, seconds, host_comparison, memory))
        progress(f"{device}->host {memory}")
        del host
    other = torch.empty_like(on_device)
    seconds = _seconds_per_call(partial(other.copy_, on_device), repeats, sync)
    within = (
        Comparison(
            f"{gpu.name} memory / 2",
            gpu.memory_bytes_per_second / 2,
            None,
            "a copy within one GPU reads and writes each byte: half the memory bandwidth at best",
        )
        if gpu
        else Comparison(note="GPU not in the catalogue")
    )
    rows.append(_copy_row("device_to_device", str(device), str(device), size_bytes, seconds, within))
    progress(f"{device} on-device copy")
    del other, on_device
    return rows


def _copies_between_gpus(
    elements: int,
    repeats: int,
    peer_comparison: Comparison,
    peer_access: list[list[bool | None]],
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """A copy from each GPU to each other one (staged through host memory where there is no peer access)."""
    rows = []
    count = torch.cuda.device_count()
    for source_index in range(count):
        for destination_index in range(count):
            if source_index == destination_index:
                continue
            source = torch.ones(elements, dtype=torch.float32, device=f"cuda:{source_index}")
            destination = torch.empty(elements, dtype=torch.float32, device=f"cuda:{destination_index}")

            def sync_both(a: int = source_index, b: int = destination_index) -> None:
                torch.cuda.synchronize(a)
                torch.cuda.synchronize(b)

            seconds = _seconds_per_call(partial(destination.copy_, source), repeats, sync_both)
            comparison = peer_comparison
            if not peer_access[source_index][destination_index]:
                comparison = Comparison(
                    peer_comparison.name,
                    peer_comparison.nominal_bytes_per_second,
                    peer_comparison.typical_bytes_per_second,
                    "no peer access: the copy is staged through host memory",
                )
            source_name, destination_name = f"cuda:{source_index}", f"cuda:{destination_index}"
            rows.append(_copy_row("device_to_device", source_name, destination_name, elements * 4, seconds, comparison))
            progress(f"{source_name}->{destination_name}")
            del source, destination
    return rows
