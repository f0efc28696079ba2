"""The whole check-up behind `dpkit doctor`: its options, then the devices, the copies and the collectives
measured, each against the catalogue, with notes on what stands out; the report as a JSON-ready dict."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dpkit.plan.catalogue import Catalogue, Link
from dpkit.tools.doctor.bandwidth import message_sizes
from dpkit.tools.doctor.collectives import COLLECTIVES, best_bus_bandwidth, collective_rows, measure_collectives
from dpkit.tools.doctor.comparison import LOW_FRACTION_OF_TYPICAL, link_comparison, resolve_link
from dpkit.tools.doctor.copies import measure_cpu_copy, measure_cuda_copies
from dpkit.tools.doctor.machine import describe_devices, detect_accelerator, peer_access_matrix


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


def checked_options(options: DoctorOptions) -> tuple[str, ResolvedDoctorOptions]:
    """(the accelerator, the options with its defaults), every option checked before anything is measured."""
    accelerator = detect_accelerator(options.accelerator)
    resolved = options.resolved(accelerator)
    for name in resolved.collectives:
        if name not in COLLECTIVES:
            raise ValueError(f"collectives: unknown collective {name!r}; expected {', '.join(COLLECTIVES)}")
    for flag, value, low in (
        ("processes", resolved.processes, 1),
        ("iterations", resolved.iterations, 1),
        ("warmup", resolved.warmup, 0),
        ("copy_bytes", resolved.copy_bytes, 4),
        ("copy_repeats", resolved.copy_repeats, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{flag}: expected an integer >= {low}, got {value!r}")
    return accelerator, resolved


def run_doctor(options: DoctorOptions | None = None) -> dict[str, Any]:
    """Measure this machine; the report as a JSON-ready dict (see dpkit.cli.doctor for the table)."""
    accelerator, resolved = checked_options(options or DoctorOptions())
    sizes = message_sizes(resolved.min_bytes, resolved.max_bytes, resolved.factor)
    catalogue = Catalogue.load(resolved.catalogue_file)
    backend = "nccl" if accelerator == "cuda" else "gloo"
    if accelerator == "cuda" and resolved.processes > torch.cuda.device_count():
        raise ValueError(f"processes: {resolved.processes} but only {torch.cuda.device_count()} GPU(s) are visible")

    report: dict[str, Any] = {
        "accelerator": accelerator,
        "backend": backend,
        "world_size": resolved.processes,
        "torch_version": torch.__version__,
        "devices": describe_devices(accelerator, catalogue),
        "peer_access": None,
        "links": {},
        "copies": [],
        "collectives": [],
        "notes": [],
    }
    if accelerator == "cuda":
        peer_link = _cuda_copies(resolved, catalogue, report)
    else:
        peer_link = _cpu_copy(resolved, catalogue, report)
    _collectives(resolved, backend, sizes, peer_link, report)
    report.setdefault("summary", {})
    report["sizes_bytes"] = sizes
    _flag_low_figures(report)
    return report


def _cuda_copies(
    options: ResolvedDoctorOptions, catalogue: Catalogue, report: dict[str, Any]
) -> tuple[Link | None, bool]:
    """The GPUs' links (given, or the catalogue's usual ones for the GPU model) and their copies, in the report;
    the link between GPUs and whether it was inferred."""
    from tqdm import tqdm

    notes, devices = report["notes"], report["devices"]
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
        index: resolve_link(catalogue, options.host_link, gpu.host_link if gpu else None, "host_link")
        for index, gpu in gpus.items()
    }
    first = gpus.get(0)
    peer_default = first.usual_link if first else None  # the catalogue's usual link for the GPU
    peer_link = resolve_link(catalogue, options.link, peer_default, "link")
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
    return peer_link


def _cpu_copy(options: ResolvedDoctorOptions, catalogue: Catalogue, report: dict[str, Any]) -> tuple[Link | None, bool]:
    """A memory copy in the report; the link given to compare collectives with (none applies by itself)."""
    from tqdm import tqdm

    peer_link = resolve_link(catalogue, options.link, None, "link")
    report["links"] = {"host": None, "peer": peer_link[0].name if peer_link[0] else None, "inferred": False}
    if peer_link[0] is None:
        report["notes"].append(
            "CPU only: the virtual devices share host memory and gloo runs over loopback, so no catalogue link "
            "applies and ratios are empty; --link NAME compares with one"
        )
    with tqdm(total=1, desc="doctor memory copy", disable=not options.progress, leave=False) as bar:
        report["copies"] = measure_cpu_copy(options.copy_bytes, options.copy_repeats)
        bar.update()
    return peer_link


def _collectives(
    options: ResolvedDoctorOptions,
    backend: str,
    sizes: list[int],
    peer_link: tuple[Link | None, bool],
    report: dict[str, Any],
) -> None:
    """The collectives' rows and their best bus bandwidths in the report (skipped, with a note, on one process)."""
    notes = report["notes"]
    if options.processes < 2:
        notes.append("collectives skipped: they need at least 2 processes (one GPU, or one process asked)")
        return
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
        notes.append(f"{link.name} joins at most {link.max_devices} devices, but {options.processes} ranks took part")


def _flag_low_figures(report: dict[str, Any]) -> None:
    """A note counting the figures far below what the catalogue link typically achieves, with what to check."""
    flagged = [row for row in report["copies"] + report["collectives"] if row["low"]]
    if not flagged:
        return
    advice = (
        "check slots and lanes (nvidia-smi topo -m), NCCL_P2P_DISABLE, NCCL_DEBUG=INFO"
        if report["accelerator"] == "cuda"
        else "expected on CPU: gloo over loopback is bounded by memory copies and the cores, not by the named link"
    )
    report["notes"].append(
        f"{len(flagged)} figure(s) below {LOW_FRACTION_OF_TYPICAL:.0%} of what the catalogue link typically "
        f"achieves (marked LOW): {advice}"
    )
