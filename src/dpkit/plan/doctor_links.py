"""A `dpkit doctor --json` report as a calibration (`dpkit plan --calibration doctor.json`): the link its all-reduce
measured, as the cost model's alpha-beta Link, in place of the catalogue's figures.

`--calibration` takes `dpkit bench --json` files (calibration.py fits the compute and host constants to them) and
`dpkit doctor --json` files; calibration_files tells them apart. A doctor report times a ring all-reduce at several
message sizes; the cost model's ring all-reduce of S bytes over N processes takes

    t = 2(N - 1) alpha + 2(N - 1)/N * S / beta        (transfers.ring_all_reduce_seconds)

so a least-squares line through (2(N - 1)/N * S, t) gives the bandwidth beta (1 / slope) and the latency alpha
(intercept / 2(N - 1), none where the intercept is negative). Over NCCL between GPUs it is the link between the
devices of a node; over gloo between CPU processes, the link between processes (Hardware.interprocess). A doctor
runs on one node: the network between nodes stays the catalogue's.

    files = calibration_files(["bench.json", "doctor.json"])   # (bench paths, doctor reports by path)
    link = measured_link(report, "doctor.json")
    hardware = with_measured_link(hardware, report, link)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from dpkit.plan.catalogue import Link
from dpkit.plan.configuration import Hardware

BENCH_KIND = "dpkit-bench"
DOCTOR_KIND = "dpkit-doctor"
DOCTOR_KEYS = {"accelerator", "backend", "world_size", "collectives"}  # what older doctor reports (no kind) hold


def read_json(path: str) -> dict[str, Any]:
    """A calibration file's JSON object, or one line naming the file and what is wrong."""
    if not Path(path).is_file():
        raise ValueError(
            f"calibration: no such file {path!r}; give a JSON file that dpkit bench --json or dpkit doctor --json wrote"
        )
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"calibration: {path!r} is not JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"calibration: {path!r} is not a dpkit bench or dpkit doctor JSON (not an object)")
    return data


def calibration_kind(data: dict[str, Any]) -> str | None:
    """ "bench", "doctor", or None for neither: by the file's kind, or for a doctor report without one, its keys."""
    if data.get("kind") == BENCH_KIND:
        return "bench"
    if data.get("kind") == DOCTOR_KIND or (data.get("kind") is None and data.keys() >= DOCTOR_KEYS):
        return "doctor"
    return None


def calibration_files(paths: Sequence[str]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """(the bench files, the doctor reports by path) of --calibration's files; one line for a file that is neither,
    or for more than one doctor report (one machine's links at a time)."""
    benches: list[str] = []
    doctors: dict[str, dict[str, Any]] = {}
    for path in paths:
        data = read_json(path)
        kind = calibration_kind(data)
        if kind is None:
            raise ValueError(
                f"calibration: {path!r} is neither a dpkit bench JSON (kind {BENCH_KIND!r}) nor a dpkit doctor "
                "JSON; write one with dpkit bench --json or dpkit doctor --json"
            )
        if kind == "bench":
            benches.append(path)
        else:
            doctors[path] = data
    if len(doctors) > 1:
        raise ValueError(f"calibration: give one dpkit doctor JSON (one machine's links), got {', '.join(doctors)}")
    return benches, doctors


def measured_link(report: dict[str, Any], source: str) -> Link:
    """The alpha-beta link of a doctor report's all-reduce rows (this module's docstring), named after them."""
    rows = [row for row in report.get("collectives") or [] if row.get("collective") == "all_reduce"]
    processes = int(report.get("world_size") or 0)
    if not rows or processes < 2:
        raise ValueError(
            f"calibration: {source!r} has no all-reduce measured (dpkit doctor on one process, or without "
            "--collectives all_reduce); run dpkit doctor --nproc-per-node 2 or more"
        )
    moved = [2 * (processes - 1) / processes * float(row["size_bytes"]) for row in rows]
    seconds = [float(row["seconds"]) for row in rows]
    slope, intercept = _least_squares_line(moved, seconds)
    if slope <= 0:  # one size, or times that do not grow with the bytes: the best bandwidth seen, no latency
        slope, intercept = min(t / x for x, t in zip(moved, seconds)), 0.0
    bandwidth = 1 / slope
    latency = max(0.0, intercept) / (2 * (processes - 1))
    sizes = sorted(int(row["size_bytes"]) for row in rows)
    backend = report.get("backend", "?")
    return Link(
        f"{backend} all-reduce measured",
        bandwidth,
        bandwidth,
        latency,
        f"dpkit doctor ({Path(source).name}): {backend} all-reduce over {processes} processes, {len(rows)} sizes "
        f"from {sizes[0]:,} to {sizes[-1]:,} bytes, fitted as alpha + bytes / beta",
    )


def _least_squares_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points; slope 0 when the xs do not vary."""
    count = len(xs)
    mean_x, mean_y = sum(xs) / count, sum(ys) / count
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return 0.0, mean_y
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
    return slope, mean_y - slope * mean_x


def doctor_gpu(report: dict[str, Any]) -> str | None:
    """The catalogue GPU a CUDA doctor report found (its first device's), None on CPU or for a GPU not in it."""
    devices = (report.get("devices") or {}).get("cuda") or []
    return devices[0].get("catalogue_gpu") if devices else None


def check_measured_machine(report: dict[str, Any], gpu: str | None, bench_given: bool) -> str | None:
    """The GPU to plan on (`gpu`, the --gpu given, or the one a CUDA report found), once the report is known to
    describe the machine planned: GPUs measured by NCCL, or CPU processes beside a bench of their machine."""
    if report.get("accelerator") == "cuda":
        found = gpu or doctor_gpu(report)
        if found is None:
            raise ValueError(
                "calibration: the GPUs dpkit doctor measured are not in the catalogue; name them (gpu=NAME; "
                "catalogue_file=FILE adds one)"
            )
        return found
    if gpu:
        raise ValueError(
            f"calibration: the dpkit doctor report measured gloo between CPU processes, which says nothing of "
            f"{gpu}'s link; run dpkit doctor on the GPUs, or plan this CPU machine without naming a GPU"
        )
    if not bench_given:
        raise ValueError(
            "calibration: a dpkit doctor JSON measures the links only; name the GPUs (gpu=NAME), or add a dpkit "
            "bench JSON of this machine for its compute"
        )
    return None


def with_measured_link(hardware: Hardware, report: dict[str, Any], link: Link) -> Hardware:
    """The hardware with the doctor's measured link: between the GPUs of a node (NCCL), or between the processes of
    virtual CPU devices (gloo); one line where the report measured the other kind of machine."""
    if report.get("accelerator") == "cuda":
        if hardware.shared_compute:
            raise ValueError(
                "calibration: the dpkit doctor report measured GPUs, and the plan is of virtual CPU devices; "
                "name the GPUs (gpu=NAME)"
            )
        return replace(hardware, link=link, interprocess=None)
    if not hardware.shared_compute:
        raise ValueError(
            "calibration: the dpkit doctor report measured gloo between CPU processes, which says nothing of "
            f"{hardware.gpu.name}'s link; run dpkit doctor on the GPUs, or plan the CPU machine with a dpkit bench JSON"
        )
    return replace(hardware, interprocess=link)


def measured_words(path: str, hardware: Hardware, report: dict[str, Any], link: Link) -> str:
    """The line `dpkit plan` prints: the measured link, and the figure it replaces."""
    replaced = hardware.link if report.get("accelerator") == "cuda" else hardware.interprocess
    return (
        f"link measured by dpkit doctor ({path}): {link.achieved_bytes_per_second / 1e9:.3g} GB/s, latency "
        f"{link.latency_seconds * 1e6:.3g} us"
        + (f", in place of {replaced.name}'s {replaced.achieved_bytes_per_second / 1e9:.3g} GB/s" if replaced else "")
    )
