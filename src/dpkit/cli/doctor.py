"""`dpkit doctor`: what this machine has and how fast its links really are, against the catalogue.

Prints the devices, then copy bandwidth and all-reduce / broadcast bus bandwidth (nccl-tests'
definitions) beside the catalogue link's nominal and typical figures, with ratio = measured / nominal.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from dpkit.checks import check_output_file
from dpkit.cli.vocabulary import (
    add_accelerator,
    add_catalogue,
    add_link,
    add_nproc_per_node,
    add_outputs,
    add_progress,
    add_verb,
    add_warmup,
)
from dpkit.tools.doctor.checkup import DoctorOptions, run_doctor
from dpkit.tools.doctor.collectives import COLLECTIVES

SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kb": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mb": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gb": 2**30,
    "gib": 2**30,
}


# library arguments this command spells differently
SPELLED = {"iterations": "--iters", "catalogue_file": "--catalogue", "processes": "--nproc-per-node"}


def parse_bytes(text: str) -> int:
    """'4096', '4K', '64MiB', '1G' -> bytes (binary multiples, as nccl-tests' -b/-e)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 4096, 4K, 64M or 1G, got {text!r}")
    return int(match.group(1)) * SIZE_UNITS[match.group(2).lower()]


DESCRIPTION = """\
What this machine has and how fast its links really are: the devices, host-device and device-to-device copy
bandwidth, and the bus bandwidth of all-reduce, broadcast and the other collectives (nccl-tests' definitions)
over gloo on CPU processes or NCCL on every GPU, beside the catalogue's nominal and typical figures for the
link (ratio = measured / nominal). Run it once on a new machine, before trusting a plan."""

EXAMPLES = (
    "dpkit doctor",
    "dpkit doctor --link pcie4 --json doctor.json    # compare with PCIe 4.0 x16",
    "dpkit doctor --max-bytes 256M --factor 2        # the message sizes of the collectives",
    "dpkit doctor --nproc-per-node 4 --collectives all_reduce",
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = add_verb(
        subparsers,
        "doctor",
        "devices, copy and collective bandwidth measured against the catalogue",
        DESCRIPTION,
        EXAMPLES,
    )
    add_accelerator(parser)
    add_nproc_per_node(parser, "auto", " (the ranks of the collectives)")
    parser.add_argument("--min-bytes", type=parse_bytes, help="smallest collective message (default: 4K)")
    parser.add_argument(
        "--max-bytes", type=parse_bytes, help="largest collective message (default: 1M on CPU, 64M on CUDA)"
    )
    parser.add_argument(
        "--factor", type=int, default=4, help="message size multiplier from one size to the next (default: 4)"
    )
    parser.add_argument(
        "--iters", type=int, help="timed calls per collective and size (default: 10 on CPU, 20 on CUDA)"
    )
    add_warmup(parser, 5, "untimed calls first (default: 5, as nccl-tests)")
    parser.add_argument(
        "--copy-bytes", type=parse_bytes, help="buffer for the copy measurements (default: 16M on CPU, 256M on CUDA)"
    )
    parser.add_argument(
        "--collectives", default=",".join(COLLECTIVES), help=f"comma-separated, from {', '.join(COLLECTIVES)}"
    )
    add_link(parser, "; default: the usual one of the GPU model, none on CPU")
    parser.add_argument(
        "--host-link", help="catalogue link between host and GPUs (default: the GPU model's PCIe generation)"
    )
    add_catalogue(parser)
    add_outputs(parser)
    add_progress(parser)
    return parser


def options_from_args(args: argparse.Namespace) -> DoctorOptions:
    collectives = [name.strip() for name in args.collectives.split(",") if name.strip()]
    unknown = [name for name in collectives if name not in COLLECTIVES]
    if unknown or not collectives:
        raise ValueError(
            f"--collectives: expected a comma-separated list from {', '.join(COLLECTIVES)}, got {args.collectives!r}"
        )
    return DoctorOptions(
        accelerator=args.accelerator,
        processes=None if args.nproc_per_node == "auto" else args.nproc_per_node,
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes,
        factor=args.factor,
        iterations=args.iters,
        warmup=args.warmup,
        copy_bytes=args.copy_bytes,
        collectives=collectives,
        link=args.link,
        host_link=args.host_link,
        catalogue_file=args.catalogue,
        progress=not args.no_progress,
    )


def _size(size_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size_bytes >= scale:
            value = size_bytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{size_bytes} B"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def _ratio(row: dict[str, Any]) -> str:
    if row["ratio"] is None:
        return "-"
    percent = row["ratio"] * 100
    text = f"{percent:.0f}%" if percent >= 10 else f"{percent:.2g}%"
    return text + (" LOW" if row.get("low") else "")


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = [
        "  ".join(
            str(cell).rjust(width) if i else str(cell).ljust(width) for i, (cell, width) in enumerate(zip(line, widths))
        )
        for line in [headers, *rows]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    cpu = report["devices"]["cpu"]
    parts = [
        f"dpkit doctor: {report['accelerator']}, backend {report['backend']}, {report['world_size']} process(es), "
        f"torch {report['torch_version']}",
        f"CPU: {cpu['cores']} core(s) available ({cpu['logical_cpus']} logical), torch threads {cpu['torch_threads']} "
        f"(inter-op {cpu['torch_interop_threads']})",
    ]
    if report["devices"]["cuda"]:
        parts.append(
            _table(
                ["GPU", "name", "memory", "SMs", "capability", "catalogue"],
                [
                    [
                        f"cuda:{gpu['index']}",
                        gpu["name"],
                        _size(gpu["memory_bytes"]),
                        str(gpu["multiprocessors"]),
                        gpu["compute_capability"],
                        gpu["catalogue_gpu"] or "-",
                    ]
                    for gpu in report["devices"]["cuda"]
                ],
            )
        )
    if report["peer_access"]:
        count = len(report["peer_access"])
        parts.append(
            "peer access (row can read column):\n"
            + _table(
                ["", *[f"cuda:{j}" for j in range(count)]],
                [
                    [f"cuda:{i}", *["-" if cell is None else ("yes" if cell else "NO") for cell in row]]
                    for i, row in enumerate(report["peer_access"])
                ],
            )
        )
    if report["copies"]:
        parts.append(
            "copies (GB/s = 1e9 bytes/s; ratio = measured / nominal)\n"
            + _table(
                ["copy", "memory", "size", "GB/s", "nominal", "typical", "ratio", "compared with"],
                [
                    [
                        f"{row['source']} -> {row['destination']}",
                        row["memory"] or "-",
                        _size(row["size_bytes"]),
                        _rate(row["bytes_per_second"]),
                        _rate(row["nominal_bytes_per_second"]),
                        _rate(row["typical_bytes_per_second"]),
                        _ratio(row),
                        row["compared_with"] or "nothing",
                    ]
                    for row in report["copies"]
                ],
            )
        )
    if report["collectives"]:
        parts.append(
            f"collectives over {report['backend']}, {report['world_size']} ranks (busbw as nccl-tests: "
            f"all_reduce algbw*2(n-1)/n, broadcast algbw; ratio = busbw / nominal)\n"
            + _table(
                ["collective", "size", "time us", "algbw GB/s", "busbw GB/s", "nominal", "typical", "ratio"],
                [
                    [
                        row["collective"],
                        _size(row["size_bytes"]),
                        f"{row['seconds'] * 1e6:.1f}",
                        _rate(row["algbw_bytes_per_second"]),
                        _rate(row["busbw_bytes_per_second"]),
                        _rate(row["nominal_bytes_per_second"]),
                        _rate(row["typical_bytes_per_second"]),
                        _ratio(row),
                    ]
                    for row in report["collectives"]
                ],
            )
        )
    best_lines = []
    for collective, best in report.get("summary", {}).items():
        against = (
            ""
            if best["ratio"] is None
            else f", {_ratio(best)} of nominal {_rate(best['nominal_bytes_per_second'])} GB/s"
        )
        best_lines.append(
            f"best {collective} bus bandwidth: {_rate(best['busbw_bytes_per_second'])} GB/s "
            f"at {_size(best['size_bytes'])}{against}"
        )
    if best_lines:
        parts.append("\n".join(best_lines))
    if report["notes"]:
        parts.append("\n".join(f"note: {note}" for note in report["notes"]))
    return "\n\n".join(parts)


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    check_output_file(args.json, "json")  # before anything is measured
    try:
        report = run_doctor(options)
    except RuntimeError as error:
        print(f"dpkit doctor: error: {error}", file=sys.stderr)
        return 1
    print(format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            # the kind `dpkit plan --calibration` tells a doctor report from a bench JSON by
            json.dump({"kind": "dpkit-doctor", **report}, handle, indent=2)
        print(f"\nwrote {args.json}")
    return 0
