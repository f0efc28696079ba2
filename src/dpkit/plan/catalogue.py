"""The hardware catalogue: GPUs, links between GPUs of one node, and networks between nodes.

Built-in figures live in `hardware.json` beside this module, each entry with its source. A user file
(JSON everywhere, TOML on Python 3.11+) of the same shape adds entries or overrides single fields of
built-in ones:

    {"gpus": {"my-gpu": {"peak_flops": {"32": 20e12, "tf32": 40e12, "bf16-mixed": 80e12, "16-mixed": 80e12},
                         "memory_bytes": 25769803776, "memory_bytes_per_second": 5e11, "source": "my tests"}},
     "links": {"pcie4": {"achieved_bytes_per_second": 21e9}}}

    catalogue = Catalogue.load("my-hardware.json")
    catalogue.gpu("H100-SXM").peak_flops["bf16-mixed"]     # names are case-insensitive

Units are SI throughout: FLOP/s, bytes, bytes per second (per direction, per device), seconds.

Each GPU names the links its devices can be joined by in a node, the usual one first (`links`), and the
link to the host (`host_link`): `dpkit plan` and `dpkit doctor` assume the usual link when none is named,
and the plan's advice only offers links the GPU can have.

    catalogue.usual_link("h100-sxm").name                  # "nvlink4"
    [link.name for link in catalogue.links_of("rtx-3090")]  # ["pcie4", "nvlink-bridge"]
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from importlib import resources
from typing import Any, TypeVar

PRECISIONS = ("32", "tf32", "bf16-mixed", "16-mixed")
SECTIONS = ("gpus", "links", "networks")
BUILTIN_FILE = "hardware.json"


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: dict[str, float]  # precision ("32", "tf32", "bf16-mixed", "16-mixed") -> dense FLOP/s
    memory_bytes: int
    memory_bytes_per_second: float
    source: str
    links: tuple[str, ...] = ()  # catalogue links that join this GPU's devices in a node, the usual one first
    host_link: str | None = None  # the catalogue link between host and GPU (its PCIe generation)
    # host time to launch one kernel from eager PyTorch on this GPU (None: the cost model's default)
    launch_seconds: float | None = None

    @property
    def usual_link(self) -> str | None:
        return self.links[0] if self.links else None


@dataclass(frozen=True)
class Link:
    name: str
    nominal_bytes_per_second: float  # per direction, per device
    achieved_bytes_per_second: float  # what collectives or copies typically reach on a healthy machine
    latency_seconds: float
    source: str
    max_devices: int | None = None  # None: no limit from the link itself


def normalize_name(name: str) -> str:
    """Catalogue key for a user-typed name: lower case, spaces and underscores as dashes."""
    return re.sub(r"[\s_]+", "-", str(name).strip().lower())


class Catalogue:
    """GPUs, links and networks by name; `load()` gives the built-ins plus an optional user file."""

    def __init__(self, gpus: Mapping[str, GPU], links: Mapping[str, Link], networks: Mapping[str, Link]):
        self.gpus: dict[str, GPU] = dict(gpus)
        self.links: dict[str, Link] = dict(links)
        self.networks: dict[str, Link] = dict(networks)

    @classmethod
    def load(cls, catalogue_file: str | os.PathLike | None = None) -> Catalogue:
        raw = _read_builtin()
        entries = {section: dict(raw.get(section, {})) for section in SECTIONS}
        label = f"dpkit/plan/{BUILTIN_FILE}"
        merged = {
            section: {normalize_name(name): (label, dict(body)) for name, body in entries[section].items()}
            for section in SECTIONS
        }
        if catalogue_file is not None:
            path = os.fspath(catalogue_file)
            user = read_user_file(path)
            for section in SECTIONS:
                for name, body in user.get(section, {}).items():
                    key = normalize_name(name)
                    if not isinstance(body, Mapping):
                        raise ValueError(
                            f"{path}: {section}.{name}: expected a table of fields, got {type(body).__name__}"
                        )
                    base = merged[section].get(key, (path, {}))[1]
                    combined = dict(base)
                    if (
                        section == "gpus"
                        and isinstance(body.get("peak_flops"), Mapping)
                        and isinstance(base.get("peak_flops"), Mapping)
                    ):
                        combined["peak_flops"] = {**base["peak_flops"], **body["peak_flops"]}
                        combined.update({field: value for field, value in body.items() if field != "peak_flops"})
                    else:
                        combined.update(body)
                    merged[section][key] = (path, combined)
        gpus = {name: _build_gpu(origin, name, body) for name, (origin, body) in merged["gpus"].items()}
        links = {name: _build_link(origin, "links", name, body) for name, (origin, body) in merged["links"].items()}
        networks = {
            name: _build_link(origin, "networks", name, body) for name, (origin, body) in merged["networks"].items()
        }
        for name, gpu in gpus.items():
            origin = merged["gpus"][name][0]
            for field_name, named in (("links", gpu.links), ("host_link", (gpu.host_link,) if gpu.host_link else ())):
                unknown = [link for link in named if link not in links]
                if unknown:
                    raise ValueError(
                        f"{origin}: gpus.{name}.{field_name}: unknown link {unknown[0]!r}; expected links of the "
                        f"catalogue ({', '.join(sorted(links))}) or ones the same file adds under links"
                    )
        return cls(gpus, links, networks)

    def gpu(self, name: str) -> GPU:
        return _lookup(self.gpus, name, "gpu")

    def link(self, name: str) -> Link:
        return _lookup(self.links, name, "link")

    def network(self, name: str) -> Link:
        return _lookup(self.networks, name, "network")

    def links_of(self, gpu: str | GPU) -> list[Link]:
        """The links that can join `gpu`'s devices in a node, the usual one first (none for a GPU a user file
        adds without them)."""
        gpu = gpu if isinstance(gpu, GPU) else self.gpu(gpu)
        return [self.links[name] for name in gpu.links]

    def usual_link(self, gpu: str | GPU) -> Link | None:
        """The link `gpu`'s devices usually have between them in a node (None when the catalogue does not say)."""
        links = self.links_of(gpu)
        return links[0] if links else None

    def host_link(self, gpu: str | GPU) -> Link | None:
        """The link between the host and `gpu` (its PCIe generation; None when the catalogue does not say)."""
        gpu = gpu if isinstance(gpu, GPU) else self.gpu(gpu)
        return self.links[gpu.host_link] if gpu.host_link else None

    def gpus_with_link(self, link: str) -> list[str]:
        """The GPUs whose devices `link` can join (as their usual link or another)."""
        return [name for name, gpu in self.gpus.items() if normalize_name(link) in gpu.links]

    def to_dict(self) -> dict[str, Any]:
        """Every entry in the shape of hardware.json (and of a user file), by section."""

        def entry(item: GPU | Link) -> dict[str, Any]:
            body = asdict(item)
            body.pop("name")
            if isinstance(item, GPU):
                body["links"] = list(item.links)
            return body

        return {section: {name: entry(item) for name, item in getattr(self, section).items()} for section in SECTIONS}

    def match_gpu(self, device_name: str) -> GPU | None:
        """The catalogue entry for a CUDA device name as torch reports it ("NVIDIA A100-SXM4-80GB",
        "Tesla V100-PCIE-32GB", "NVIDIA GeForce RTX 4090"), or None when no entry fits."""
        text = device_name.lower()
        if text.strip() and normalize_name(text) in self.gpus:
            return self.gpus[normalize_name(text)]
        key = None
        if "gh200" in text or "h100 nvl" in text:
            return None  # Grace Hopper and the 94 GB H100 NVL differ from every entry: add them with a user file
        if "h200" in text:
            key = "h200-sxm"
        elif "h100" in text:
            key = "h100-pcie" if "pcie" in text else "h100-sxm"
        elif "a100" in text:
            size = "80gb" if "80g" in text else "40gb"
            key = f"a100-{size}-{'pcie' if 'pcie' in text else 'sxm'}"
        elif "v100" in text:
            key = "v100-pcie" if "pcie" in text else "v100-sxm2"
        elif "titan rtx" in text:
            key = "titan-rtx"
        else:
            for pattern, candidate in (
                (r"rtx 4090", "rtx-4090"),
                (r"rtx 3090", "rtx-3090"),
                (r"\bl4\b", "l4"),
                (r"\bt4\b", "t4"),
            ):
                if re.search(pattern, text):
                    key = candidate
                    break
        return self.gpus.get(key) if key else None


Entry = TypeVar("Entry")  # a catalogue entry: GPU or Link


def _lookup(table: Mapping[str, Entry], name: str, argument: str) -> Entry:
    key = normalize_name(name) if isinstance(name, str) else None
    if key is None or key not in table:
        raise ValueError(
            f"{argument}: unknown {argument} {name!r}; choose one of {', '.join(sorted(table))} "
            f"(`dpkit catalogue {argument}s` lists them with their figures; add one with a user catalogue file)"
        )
    return table[key]


def _read_builtin() -> dict[str, Any]:
    text = resources.files("dpkit.plan").joinpath(BUILTIN_FILE).read_text(encoding="utf-8")
    return json.loads(text)


def read_user_file(path: str) -> dict[str, Any]:
    """A user catalogue file as a dict: JSON, or TOML (Python 3.11+), judged by the extension."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"catalogue_file: catalogue file {path!r} does not exist; expected a .json or .toml file with sections "
            f"{', '.join(SECTIONS)}"
        )
    extension = os.path.splitext(path)[1].lower()
    if extension == ".toml":
        try:
            import tomllib
        except ImportError as error:  # Python 3.10
            raise ValueError(
                f"{path}: TOML catalogue files need Python 3.11+ (tomllib); write it as JSON instead"
            ) from error
        try:
            with open(path, "rb") as handle:
                data = tomllib.load(handle)
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"{path}: not valid TOML ({error})") from error
    elif extension == ".json":
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from error
    else:
        raise ValueError(f"{path}: catalogue files end in .json or .toml, got {extension or 'no extension'!r}")
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a table with sections {', '.join(SECTIONS)}, got {type(data).__name__}")
    unknown = [key for key in data if key not in SECTIONS and not str(key).startswith("_")]
    if unknown:
        raise ValueError(f"{path}: unknown section {unknown[0]!r}; expected {', '.join(SECTIONS)}")
    return dict(data)


def _positive_number(origin: str, where: str, value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{origin}: {where}: expected a positive number ({what}), got {value!r}")
    return float(value)


def _check_fields(origin: str, where: str, body: Mapping[str, Any], cls: type, required: tuple[str, ...]) -> None:
    allowed = [field.name for field in fields(cls) if field.name != "name"]
    for key in body:
        if key not in allowed:
            raise ValueError(f"{origin}: {where}.{key}: unknown field; expected {', '.join(allowed)}")
    missing = [key for key in required if key not in body]
    if missing:
        raise ValueError(f"{origin}: {where}: missing field {missing[0]!r} (a new entry needs {', '.join(required)})")


def _source(origin: str, where: str, body: Mapping[str, Any]) -> str:
    source = body.get("source", f"user file {origin}")
    if not isinstance(source, str) or not source.strip():
        raise ValueError(
            f"{origin}: {where}.source: expected a non-empty string saying where the figures come from, got {source!r}"
        )
    return source


def _build_gpu(origin: str, name: str, body: Mapping[str, Any]) -> GPU:
    where = f"gpus.{name}"
    _check_fields(origin, where, body, GPU, ("peak_flops", "memory_bytes", "memory_bytes_per_second"))
    peak = body["peak_flops"]
    if not isinstance(peak, Mapping):
        raise ValueError(
            f"{origin}: {where}.peak_flops: expected a table of precision -> FLOP/s "
            f"with keys {', '.join(PRECISIONS)}, got {type(peak).__name__}"
        )
    for key in peak:
        if key not in PRECISIONS:
            raise ValueError(f"{origin}: {where}.peak_flops.{key}: unknown precision; expected {', '.join(PRECISIONS)}")
    missing = [key for key in PRECISIONS if key not in peak]
    if missing:
        raise ValueError(
            f"{origin}: {where}.peak_flops: missing precision {missing[0]!r}; give all of {', '.join(PRECISIONS)} "
            f"(the FP32 rate where the GPU has no tensor cores for it)"
        )
    peak_flops = {
        key: _positive_number(origin, f"{where}.peak_flops.{key}", peak[key], "dense FLOP/s") for key in PRECISIONS
    }
    memory = body["memory_bytes"]
    if isinstance(memory, float) and memory.is_integer():
        memory = int(memory)
    if isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0:
        raise ValueError(f"{origin}: {where}.memory_bytes: expected a positive integer number of bytes, got {memory!r}")
    bandwidth = _positive_number(
        origin, f"{where}.memory_bytes_per_second", body["memory_bytes_per_second"], "bytes per second"
    )
    links = body.get("links", [])
    if isinstance(links, str) or not isinstance(links, (list, tuple)) or not all(isinstance(x, str) for x in links):
        raise ValueError(f"{origin}: {where}.links: expected a list of link names, the usual one first, got {links!r}")
    host_link = body.get("host_link")
    if host_link is not None and not isinstance(host_link, str):
        raise ValueError(f"{origin}: {where}.host_link: expected a link name such as 'pcie4', got {host_link!r}")
    launch = body.get("launch_seconds")
    if launch is not None:
        launch = _positive_number(origin, f"{where}.launch_seconds", launch, "seconds of host time per kernel launch")
    return GPU(
        name=name,
        peak_flops=peak_flops,
        memory_bytes=memory,
        memory_bytes_per_second=bandwidth,
        source=_source(origin, where, body),
        links=tuple(normalize_name(link) for link in links),
        host_link=normalize_name(host_link) if host_link else None,
        launch_seconds=launch,
    )


def _build_link(origin: str, section: str, name: str, body: Mapping[str, Any]) -> Link:
    where = f"{section}.{name}"
    _check_fields(
        origin, where, body, Link, ("nominal_bytes_per_second", "achieved_bytes_per_second", "latency_seconds")
    )
    nominal = _positive_number(
        origin, f"{where}.nominal_bytes_per_second", body["nominal_bytes_per_second"], "bytes per second, per direction"
    )
    achieved = _positive_number(
        origin,
        f"{where}.achieved_bytes_per_second",
        body["achieved_bytes_per_second"],
        "bytes per second, per direction",
    )
    if achieved > nominal:
        raise ValueError(
            f"{origin}: {where}.achieved_bytes_per_second: {achieved:g} exceeds nominal_bytes_per_second {nominal:g}; "
            f"expected achieved <= nominal"
        )
    latency = _positive_number(origin, f"{where}.latency_seconds", body["latency_seconds"], "seconds")
    max_devices = body.get("max_devices")
    if max_devices is not None and (
        isinstance(max_devices, bool) or not isinstance(max_devices, int) or max_devices < 2
    ):
        raise ValueError(f"{origin}: {where}.max_devices: expected an integer >= 2 or no value, got {max_devices!r}")
    return Link(
        name=name,
        nominal_bytes_per_second=nominal,
        achieved_bytes_per_second=achieved,
        latency_seconds=latency,
        source=_source(origin, where, body),
        max_devices=max_devices,
    )
