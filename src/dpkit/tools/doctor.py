"""What this machine has and how fast its links really are: the measurements behind `dpkit doctor`.

- Devices: CPU cores and torch threads; each GPU's name, memory, SMs and compute capability.
- Copies: on CUDA, host->device and device->host (pinned and pageable host memory), a copy within each
  GPU and between each pair of GPUs; on CPU, a memory copy (what moving a tensor between virtual CPU
  devices costs).
- Collectives: all-reduce and broadcast over the backend in use (gloo on CPU, NCCL on GPUs), one process
  per device on loopback, with nccl-tests' definitions (see PERFORMANCE.md in NVIDIA/nccl-tests):
  algbw = bytes / time; busbw = algbw * factor, the factor being 2(n-1)/n for all-reduce and 1 for
  broadcast, so that busbw is comparable with one link's per-direction bandwidth whatever n is.
- Peer access between GPUs (torch.cuda.can_device_access_peer).

Each figure stands beside the nominal one from the catalogue (dpkit.plan.catalogue) with the ratio, and
beside the typically achieved one, so a misconfigured machine (a GPU in an x4 slot, P2P disabled, NCCL
falling back to sockets) stands out.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import torch

from dpkit.plan.catalogue import GPU, Catalogue, Link

log = logging.getLogger("dpkit")

COLLECTIVES = ("all_reduce", "broadcast")
# a measured figure below this fraction of the catalogue's typically achieved one is flagged
LOW_FRACTION_OF_TYPICAL = 0.5

# ---------------------------------------------------------------- bandwidth definitions (nccl-tests)


def algorithm_bandwidth(size_bytes: int, seconds: float) -> float:
    """nccl-tests' algbw: the bytes of one rank's buffer over the time the collective took."""
    if seconds <= 0:
        raise ValueError(f"seconds: expected a positive duration, got {seconds!r}")
    return size_bytes / seconds


def bus_bandwidth_factor(collective: str, world_size: int) -> float:
    """busbw / algbw for a collective over world_size ranks, as nccl-tests defines it.

    A ring all-reduce sends and receives 2(n-1)/n of the buffer per rank (reduce-scatter then
    all-gather); a pipelined broadcast moves the whole buffer once through every link.
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected at least 1, got {world_size}")
    factors = {
        "all_reduce": 2 * (world_size - 1) / world_size,
        "all_gather": (world_size - 1) / world_size,
        "reduce_scatter": (world_size - 1) / world_size,
        "broadcast": 1.0,
        "reduce": 1.0,
    }
    if collective not in factors:
        raise ValueError(f"collective: unknown collective {collective!r}; expected one of {', '.join(factors)}")
    return factors[collective]


def bus_bandwidth(collective: str, size_bytes: int, seconds: float, world_size: int) -> float:
    return algorithm_bandwidth(size_bytes, seconds) * bus_bandwidth_factor(collective, world_size)


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """min_bytes, min_bytes*factor, ... up to max_bytes (which is included even off the progression)."""
    if min_bytes < 4 or max_bytes < min_bytes:
        raise ValueError(f"message sizes: expected 4 <= min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    if factor < 2:
        raise ValueError(f"factor: expected an integer >= 2, got {factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    if sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes


# ---------------------------------------------------------------- options and comparison


@dataclass
class DoctorOptions:
    accelerator: str = "auto"  # "auto", "cpu" or "cuda"
    processes: int | None = None  # collective ranks; default 2 on CPU, every GPU on CUDA
    min_bytes: int | None = None  # collective message sizes; defaults depend on the accelerator
    max_bytes: int | None = None
    factor: int = 4
    iterations: int | None = None  # timed collectives per size
    warmup: int = 5
    copy_bytes: int | None = None  # buffer size for the copy measurements
    copy_repeats: int = 5
    collectives: Sequence[str] = COLLECTIVES
    link: str | None = None  # catalogue link between devices to compare with
    host_link: str | None = None  # catalogue link between host and GPU (CUDA)
    catalogue_file: str | None = None
    progress: bool = True
    timeout_seconds: float = 120.0

    def resolved(self, accelerator: str) -> ResolvedDoctorOptions:
        cuda = accelerator == "cuda"
        defaults = {
            "processes": torch.cuda.device_count() if cuda else 2,
            "min_bytes": 4 * 2**10,
            "max_bytes": 64 * 2**20 if cuda else 1 * 2**20,
            "iterations": 20 if cuda else 10,
            "copy_bytes": 256 * 2**20 if cuda else 16 * 2**20,
        }
        values = {
            name: (getattr(self, name) if getattr(self, name) is not None else default)
            for name, default in defaults.items()
        }
        return ResolvedDoctorOptions(**{**self.__dict__, **values})


@dataclass
class ResolvedDoctorOptions(DoctorOptions):
    """DoctorOptions with the accelerator's defaults in place of the Nones."""

    processes: int = 2
    min_bytes: int = 4 * 2**10
    max_bytes: int = 1 * 2**20
    iterations: int = 10
    copy_bytes: int = 16 * 2**20


@dataclass
class Comparison:
    """What a measured figure is compared with: a catalogue entry's nominal and typical bandwidth."""

    name: str | None = None  # e.g. "pcie4", "h100-sxm memory / 2"; None: nothing applies
    nominal_bytes_per_second: float | None = None
    typical_bytes_per_second: float | None = None
    note: str = ""

    def fields(self, measured_bytes_per_second: float, judge: bool = True) -> dict[str, Any]:
        """judge=False where falling short of the link says nothing about the machine (latency-bound
        small messages, pageable copies staged through a pinned buffer)."""
        ratio = measured_bytes_per_second / self.nominal_bytes_per_second if self.nominal_bytes_per_second else None
        low = (
            judge
            and self.typical_bytes_per_second is not None
            and measured_bytes_per_second < LOW_FRACTION_OF_TYPICAL * self.typical_bytes_per_second
        )
        return {
            "compared_with": self.name,
            "nominal_bytes_per_second": self.nominal_bytes_per_second,
            "typical_bytes_per_second": self.typical_bytes_per_second,
            "ratio": ratio,
            "low": low,
        }


def link_comparison(link: Link | None, inferred: bool) -> Comparison:
    if link is None:
        return Comparison()
    how = "inferred from the GPU model" if inferred else "given"
    return Comparison(
        link.name, link.nominal_bytes_per_second, link.achieved_bytes_per_second, f"catalogue link {link.name} ({how})"
    )


# ---------------------------------------------------------------- devices


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


# ---------------------------------------------------------------- copies


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
    rows = []
    count = torch.cuda.device_count()
    elements = size_bytes // 4
    size_bytes = elements * 4
    for index in range(count):
        device = torch.device("cuda", index)
        sync = lambda device=device: torch.cuda.synchronize(device)
        on_device = torch.ones(elements, dtype=torch.float32, device=device)
        host_comparison = link_comparison(*host_links[index])
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
        gpu = gpus.get(index)
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
    peer_comparison = link_comparison(*peer_link)
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
            rows.append(
                _copy_row(
                    "device_to_device",
                    f"cuda:{source_index}",
                    f"cuda:{destination_index}",
                    size_bytes,
                    seconds,
                    comparison,
                )
            )
            progress(f"cuda:{source_index}->cuda:{destination_index}")
            del source, destination
    return rows


# ---------------------------------------------------------------- collectives (one process per rank)


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
        synchronize: Callable[[], None] = lambda: torch.cuda.synchronize(device)
    else:
        torch.set_num_threads(cpu_threads_per_device(world_size))
        device = torch.device("cpu")
        synchronize = lambda: None  # gloo calls return when done
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
            results.append({"collective": collective, "size_bytes": size_bytes, "seconds": float(elapsed.item())})
            bar.update()
    barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(result_path, "w", encoding="utf-8") as handle:
            json.dump(results, handle)
    exit_worker(0)  # the work is done and written: skip interpreter teardown, where gloo can abort under load


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
        try:
            mp.start_processes(
                _collective_worker,
                nprocs=world_size,
                join=True,
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
        except ProcessException as error:
            last_line = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            raise RuntimeError(f"doctor: a {backend} worker failed ({last_line})") from error
        finally:
            if saved is None:
                os.environ.pop("GLOO_SOCKET_IFNAME", None)
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


# ---------------------------------------------------------------- the whole check-up


def _resolve_link(
    catalogue: Catalogue, given: str | None, inferred_name: str | None, argument: str
) -> tuple[Link | None, bool]:
    if given is not None:
        try:
            return catalogue.link(given), False
        except ValueError as error:
            raise ValueError(f"{argument}: {error}") from None
    return (catalogue.link(inferred_name), True) if inferred_name else (None, False)


def run_doctor(options: DoctorOptions | None = None) -> dict[str, Any]:
    """Measure this machine; the report as a JSON-ready dict (see dpkit.cli.doctor for the table)."""
    from tqdm import tqdm

    options = options or DoctorOptions()
    accelerator = detect_accelerator(options.accelerator)
    options = options.resolved(accelerator)
    for name in options.collectives:
        if name not in COLLECTIVES:
            raise ValueError(f"collectives: unknown collective {name!r}; expected {', '.join(COLLECTIVES)}")
    for flag, value, low in (
        ("processes", options.processes, 1),
        ("iterations", options.iterations, 1),
        ("warmup", options.warmup, 0),
        ("copy_bytes", options.copy_bytes, 4),
        ("copy_repeats", options.copy_repeats, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{flag}: expected an integer >= {low}, got {value!r}")
    sizes = message_sizes(options.min_bytes, options.max_bytes, options.factor)
    catalogue = Catalogue.load(options.catalogue_file)
    backend = "nccl" if accelerator == "cuda" else "gloo"
    if accelerator == "cuda" and options.processes > torch.cuda.device_count():
        raise ValueError(f"processes: {options.processes} but only {torch.cuda.device_count()} GPU(s) are visible")

    devices = describe_devices(accelerator, catalogue)
    notes: list[str] = []
    report: dict[str, Any] = {
        "accelerator": accelerator,
        "backend": backend,
        "world_size": options.processes,
        "torch_version": torch.__version__,
        "devices": devices,
        "peer_access": None,
        "links": {},
        "copies": [],
        "collectives": [],
        "notes": notes,
    }

    if accelerator == "cuda":
        gpus = {
            entry["index"]: (catalogue.gpu(entry["catalogue_gpu"]) if entry["catalogue_gpu"] else None)
            for entry in devices["cuda"]
        }
        for entry in devices["cuda"]:
            if entry["catalogue_gpu"] is None:
                notes.append(
                    f"cuda:{entry['index']} ({entry['name']}) is not in the catalogue; add it with --catalogue FILE"
                )
        host_links = {
            index: _resolve_link(catalogue, options.host_link, gpu.host_link if gpu else None, "host_link")
            for index, gpu in gpus.items()
        }
        first = gpus.get(0)
        peer_default = first.usual_link if first else None  # the catalogue's usual link for the GPU
        peer_link = _resolve_link(catalogue, options.link, peer_default, "link")
        report["peer_access"] = peer_access_matrix(torch.cuda.device_count())
        report["links"] = {
            "host": {str(i): (link.name if link else None) for i, (link, _) in host_links.items()},
            "peer": peer_link[0].name if peer_link[0] else None,
            "inferred": options.link is None,
        }
        if peer_link[1] and peer_link[0] is not None and first is not None:  # (inferred from the first GPU)
            notes.append(
                f"compared with {peer_link[0].name}, the catalogue's usual link for {first.name} (an SXM board is "
                f"assumed to use NVLink through NVSwitch); say which link the GPUs have with --link NAME "
                f"(`dpkit catalogue links` lists them)"
            )
        pairs = torch.cuda.device_count() * (torch.cuda.device_count() - 1)
        with tqdm(
            total=5 * torch.cuda.device_count() + pairs,
            desc="doctor copies",
            unit="copy",
            disable=not options.progress,
            leave=False,
        ) as bar:
            report["copies"] = measure_cuda_copies(
                options.copy_bytes,
                options.copy_repeats,
                host_links,
                peer_link,
                gpus,
                report["peer_access"],
                lambda _: bar.update(),
            )
        torch.cuda.empty_cache()  # the collective workers get the GPUs' memory back
    else:
        peer_link = _resolve_link(catalogue, options.link, None, "link")
        report["links"] = {"host": None, "peer": peer_link[0].name if peer_link[0] else None, "inferred": False}
        if peer_link[0] is None:
            notes.append(
                "CPU only: the virtual devices share host memory and gloo runs over loopback, so no catalogue link "
                "applies and ratios are empty; --link NAME compares with one"
            )
        with tqdm(total=1, desc="doctor memory copy", disable=not options.progress, leave=False) as bar:
            report["copies"] = measure_cpu_copy(options.copy_bytes, options.copy_repeats)
            bar.update()

    if options.processes < 2:
        notes.append("collectives skipped: they need at least 2 processes (one GPU, or one process asked)")
    else:
        timings = measure_collectives(
            backend,
            options.processes,
            sizes,
            list(options.collectives),
            options.iterations,
            options.warmup,
            options.progress,
            options.timeout_seconds,
        )
        report["collectives"] = collective_rows(timings, options.processes, link_comparison(*peer_link))
        report["summary"] = best_bus_bandwidth(report["collectives"])
        link = peer_link[0]
        if link is not None and link.max_devices is not None and options.processes > link.max_devices:
            notes.append(
                f"{link.name} joins at most {link.max_devices} devices, but {options.processes} ranks took part"
            )
    report.setdefault("summary", {})
    report["sizes_bytes"] = sizes
    flagged = [row for row in report["copies"] + report["collectives"] if row["low"]]
    if flagged:
        advice = (
            "check slots and lanes (nvidia-smi topo -m), NCCL_P2P_DISABLE, NCCL_DEBUG=INFO"
            if accelerator == "cuda"
            else "expected on CPU: gloo over loopback is bounded by memory copies and the cores, not by the named link"
        )
        notes.append(
            f"{len(flagged)} figure(s) below {LOW_FRACTION_OF_TYPICAL:.0%} of what the catalogue link typically "
            f"achieves (marked LOW): {advice}"
        )
    return report
