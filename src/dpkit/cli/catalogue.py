"""`dpkit catalogue`: the GPUs, links and networks that `dpkit plan` and `dpkit doctor` know, with their figures.

dpkit catalogue                      # all three tables
dpkit catalogue links                # one of them
dpkit catalogue gpus --catalogue mine.json --json catalogue.json
"""

from __future__ import annotations

import argparse
import json

from dpkit.checks import check_output_file
from dpkit.cli import vocabulary
from dpkit.plan.catalogue import SECTIONS, Catalogue, Link
from dpkit.plan.constants import CostConstants
from dpkit.plan.tables import fitted_table, table_wrapping_last, wrap

SPELLED = {"catalogue_file": "--catalogue"}

DESCRIPTION = """\
List the hardware catalogue that dpkit plan predicts with and dpkit doctor compares against: each
GPU's memory, memory bandwidth, dense TFLOPS per precision and the links its devices can be joined
by (the usual one first, which plan and doctor assume when --link is not given); each link's and
network's bandwidth per direction, nominal and typically achieved, its latency and how many devices
it joins. Every figure has a source, in the --json output and in dpkit/plan/hardware.json;
--catalogue adds or corrects entries from a file of yours."""

EXAMPLES = [
    "dpkit catalogue",
    "dpkit catalogue gpus",
    "dpkit catalogue links --catalogue my-hardware.json",
    "dpkit catalogue networks --json networks.json",
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = vocabulary.add_verb(
        subparsers, "catalogue", "list the catalogue's GPUs, links and networks", DESCRIPTION, EXAMPLES
    )
    parser.add_argument(
        "section", nargs="?", choices=SECTIONS, help="one section (default: all three: gpus, links, networks)"
    )
    vocabulary.add_catalogue(parser)
    vocabulary.add_outputs(parser)
    return parser


def _tflops(flops: float) -> str:
    return f"{flops / 1e12:,.1f}"


def _gigabytes(bytes_per_second: float) -> str:
    return f"{bytes_per_second / 1e9:.4g}"


def gpu_lines(catalogue: Catalogue) -> list[str]:
    header = ["gpu", "links, usual first", "host", "GiB", "TB/s", "32", "tf32", "bf16-mixed", "16-mixed"]
    rows = [
        [
            name,
            ", ".join(gpu.links) or "-",
            gpu.host_link or "-",
            f"{gpu.memory_bytes / 2**30:.0f}",
            f"{gpu.memory_bytes_per_second / 1e12:.2f}",
            *(_tflops(gpu.peak_flops[precision]) for precision in ("32", "tf32", "bf16-mixed", "16-mixed")),
        ]
        for name, gpu in sorted(catalogue.gpus.items())
    ]
    constants = CostConstants()
    lines = wrap(
        "GPUs: the links that join a node's GPUs (the usual one first) and the link to the host; memory (GiB) "
        "and its bandwidth (TB/s); dense TFLOPS per precision"
    )
    lines += fitted_table(header, rows, keep=1, left=3)
    launches = sorted({gpu.launch_seconds or constants.launch_seconds for gpu in catalogue.gpus.values()})
    lines += wrap(
        "Host time per kernel launch: "
        + ", ".join(f"{seconds * 1e6:g} µs" for seconds in launches)
        + " (the catalogue's launch_seconds of each GPU); "
        f"{constants.compute_efficiency:.0%} of peak reached in a training step, a cost constant (dpkit plan "
        "--calibration fits both to a dpkit bench run)."
    )
    return lines


def _link_rows(links: dict[str, Link]) -> list[list[str]]:
    return [
        [
            name,
            _gigabytes(link.nominal_bytes_per_second),
            _gigabytes(link.achieved_bytes_per_second),
            f"{link.latency_seconds * 1e6:g}",
            str(link.max_devices) if link.max_devices else "-",
        ]
        for name, link in sorted(links.items(), key=lambda item: item[1].nominal_bytes_per_second)
    ]


LINK_HEADER = ["name", "nominal GB/s", "typical GB/s", "latency µs", "joins"]
LINK_CAPTION = "bandwidth per direction and device, nominal and typically achieved"


def link_lines(catalogue: Catalogue) -> list[str]:
    rows = _link_rows(catalogue.links)
    for row in rows:
        gpus = catalogue.gpus_with_link(row[0])
        usual = [name for name in gpus if catalogue.gpus[name].usual_link == row[0]]
        others = [name for name in gpus if name not in usual]
        row.append(", ".join(usual + [f"({name})" for name in others]) or "-")
    lines = wrap(
        f"links between the GPUs of a node: {LINK_CAPTION}; joins: at most that many devices; GPUs: those whose usual "
        "link it is, in brackets those that can have it"
    )
    return lines + table_wrapping_last([*LINK_HEADER, "GPUs"], rows)


def network_lines(catalogue: Catalogue) -> list[str]:
    lines = wrap(f"networks between nodes: {LINK_CAPTION}")
    return lines + fitted_table(LINK_HEADER[:-1], [row[:-1] for row in _link_rows(catalogue.networks)])


def run(args: argparse.Namespace) -> int:
    check_output_file(args.json, "json")  # before the tables are printed
    catalogue = Catalogue.load(args.catalogue)
    sections = [args.section] if args.section else list(SECTIONS)
    print(
        "dpkit catalogue: built-in (dpkit/plan/hardware.json)" + (f" with {args.catalogue}" if args.catalogue else "")
    )
    writers = {"gpus": gpu_lines, "links": link_lines, "networks": network_lines}
    for section in sections:
        print("\n" + "\n".join(writers[section](catalogue)))
    if args.json:
        entries = catalogue.to_dict()
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({section: entries[section] for section in sections}, handle, indent=2)
        print(f"\nwrote {args.json}")
    return 0
