"""Collective bandwidth: each collective at each message size, timed in one fresh process per rank on
loopback (gloo on CPU, NCCL on GPUs), as the slowest rank saw it; the rows with nccl-tests' bandwidths."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import torch

from dpkit.tools.doctor.bandwidth import algorithm_bandwidth, bus_bandwidth_factor
from dpkit.tools.doctor.comparison import Comparison

COLLECTIVES = ("all_reduce", "broadcast")


def _collective_worker(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    sizes: list[int],
    collectives: list[str],
    iterations: int,
    warmup: int,
    result_path: str,
    show_progress: bool,
    timeout_seconds: float,
) -> None:
    import torch.distributed as dist
    from tqdm import tqdm

    from dpkit.devices import cpu_threads_per_device
    from dpkit.launch.worker import exit_worker

    # a thread lock for tqdm: its default multiprocessing lock would be left to the resource tracker
    # by exit_worker below
    tqdm.set_lock(threading.RLock())
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(cpu_threads_per_device(world_size))
        device = torch.device("cpu")
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_seconds),
    )
    barrier = (lambda: dist.barrier(device_ids=[rank])) if cuda else dist.barrier
    results = []
    steps = [(collective, size) for collective in collectives for size in sizes]
    with tqdm(
        total=len(steps),
        desc=f"doctor {backend} collectives",
        unit="size",
        disable=not (show_progress and rank == 0),
        leave=False,
    ) as bar:
        for collective, size_bytes in steps:
            seconds = _seconds_per_collective(collective, size_bytes, device, iterations, warmup, barrier)
            results.append({"collective": collective, "size_bytes": size_bytes, "seconds": seconds})
            bar.update()
    barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(result_path, "w", encoding="utf-8") as handle:
            json.dump(results, handle)
    exit_worker(0)  # the work is done and written: skip interpreter teardown, where gloo can abort under load


def _seconds_per_collective(
    collective: str, size_bytes: int, device: torch.device, iterations: int, warmup: int, barrier: Callable[[], object]
) -> float:
    """Seconds per call of `collective` on a buffer of size_bytes, on the slowest rank."""
    import torch.distributed as dist

    if device.type == "cuda":
        synchronize: Callable[[], None] = lambda: torch.cuda.synchronize(device)
    else:
        synchronize = lambda: None  # gloo calls return when done
    buffer = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    if collective == "all_reduce":
        call = partial(dist.all_reduce, buffer)
    else:
        call = partial(dist.broadcast, buffer, src=0)
    for _ in range(warmup):
        call()
    synchronize()
    barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    synchronize()
    elapsed = torch.tensor([(time.perf_counter() - start) / iterations], dtype=torch.float64, device=device)
    # the collective is as slow as its slowest rank
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def measure_collectives(
    backend: str,
    world_size: int,
    sizes: list[int],
    collectives: Sequence[str],
    iterations: int,
    warmup: int,
    show_progress: bool,
    timeout_seconds: float,
) -> list[dict[str, Any]]:
    """Time each collective at each size in world_size fresh processes; seconds per call, slowest rank."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    from dpkit.launch import free_port, loopback_interface

    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    interface = loopback_interface() if backend == "gloo" else None
    if interface and saved is None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface  # keep gloo on loopback, as dpkit's launcher does
    with tempfile.TemporaryDirectory(prefix="dpkit-doctor-") as folder:
        result_path = os.path.join(folder, "collectives.json")
        context = None
        try:
            context = mp.start_processes(
                _collective_worker,
                nprocs=world_size,
                join=False,
                start_method="spawn",
                args=(
                    world_size,
                    backend,
                    free_port(),
                    list(sizes),
                    list(collectives),
                    iterations,
                    warmup,
                    result_path,
                    show_progress,
                    timeout_seconds,
                ),
            )
            while not context.join():
                pass
        except ProcessException as error:
            last_line = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            raise RuntimeError(f"doctor: a {backend} worker failed ({last_line})") from error
        finally:
            if saved is None:
                os.environ.pop("GLOO_SOCKET_IFNAME", None)
            for error_file in context.error_files if context is not None else ():
                # torch's spawn leaves a failed worker's traceback file in the temporary folder once it has read it
                with contextlib.suppress(OSError):
                    os.unlink(error_file)
        with open(result_path, encoding="utf-8") as handle:
            return json.load(handle)


def collective_rows(timings: list[dict[str, Any]], world_size: int, comparison: Comparison) -> list[dict[str, Any]]:
    rows = []
    largest = max((timing["size_bytes"] for timing in timings), default=0)
    for timing in timings:
        algbw = algorithm_bandwidth(timing["size_bytes"], timing["seconds"])
        busbw = algbw * bus_bandwidth_factor(timing["collective"], world_size)
        row = {**timing, "world_size": world_size, "algbw_bytes_per_second": algbw, "busbw_bytes_per_second": busbw}
        row.update(comparison.fields(busbw, judge=timing["size_bytes"] == largest))
        rows.append(row)
    return rows


def best_bus_bandwidth(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per collective, the highest bus bandwidth over the message sizes, where it was reached and its ratio."""
    summary: dict[str, dict[str, Any]] = {}
    for row in rows:
        best = summary.get(row["collective"])
        if best is None or row["busbw_bytes_per_second"] > best["busbw_bytes_per_second"]:
            summary[row["collective"]] = {
                "busbw_bytes_per_second": row["busbw_bytes_per_second"],
                "size_bytes": row["size_bytes"],
                "nominal_bytes_per_second": row["nominal_bytes_per_second"],
                "ratio": row["ratio"],
            }
    return summary
