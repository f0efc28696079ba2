"""The hardware `auto`'s step times are for, with its constants and a line saying which: on GPUs the catalogue's
figures for the GPU torch reports (its usual link), or the hardware given; on virtual CPU devices a calibration
(a Calibration, or `dpkit bench --json` files of this machine), else a probe of this machine (plan/probe.py).
A GPU calibration fits the host's constants."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import TypeAlias

import torch

from dpkit.plan.calibration import Calibration, calibrate
from dpkit.plan.catalogue import GPU, Catalogue
from dpkit.plan.configuration import Hardware
from dpkit.plan.constants import CostConstants

# what calibration= takes: a fitted Calibration, or the `dpkit bench --json` file(s) to fit one to
CalibrationSource: TypeAlias = Calibration | str | os.PathLike | Sequence[str | os.PathLike]


def host_memory_bytes() -> int:
    """The host's physical memory (virtual CPU devices share it)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not every system names these
        return 64 * 2**30


def machine_for(
    devices: list[torch.device], calibration: CalibrationSource | None, hardware: Hardware | None
) -> tuple[Hardware, CostConstants, str]:
    """(hardware, constants, the hardware in words) for the devices given."""
    count = len(devices)
    if devices[0].type == "cpu":
        if hardware is not None:
            fitted = _calibration(calibration, None) if calibration is not None else None
            return hardware, fitted.constants if fitted else CostConstants(), f"{count} virtual CPU devices (given)"
        if calibration is None:
            if count == 1:
                return _one_cpu(), CostConstants(), "1 virtual CPU device"
            from dpkit.plan.probe import probe_machine  # runs the probe models: only when needed

            fitted = probe_machine(count)
        else:
            fitted = _calibration(calibration, None)
            if fitted.hardware is None:
                raise ValueError("calibration: it was fitted on GPUs; virtual CPU devices need a CPU bench's")
        machine, constants = fitted.for_hardware(None)
        machine = replace(machine, gpu=replace(machine.gpu, memory_bytes=host_memory_bytes()))
        return machine, constants, f"{count} virtual CPU devices, constants from {fitted.source}"
    if hardware is None:
        hardware, described = _gpu_hardware(devices)
    else:
        described = f"{count}x {hardware.gpu.name}, link {hardware.link.name} (given)"
    if calibration is None:
        return hardware, CostConstants(), described
    fitted = _calibration(calibration, hardware)
    machine, constants = fitted.for_hardware(hardware)
    return machine, constants, described + f", host constants from {fitted.source}"


def _one_cpu() -> Hardware:
    from dpkit.plan.catalogue import Link

    cpu = GPU(
        "virtual CPU device", {p: 1e10 for p in ("32", "tf32", "bf16-mixed", "16-mixed")}, host_memory_bytes(), 1e10, ""
    )
    return Hardware(cpu, Link("in-process copy", 1e10, 1e10, 2e-6, ""), shared_compute=True)


def _calibration(calibration: CalibrationSource, hardware: Hardware | None) -> Calibration:
    if isinstance(calibration, Calibration):
        return calibration
    if isinstance(calibration, (str, os.PathLike, list, tuple)):
        return calibrate(calibration, hardware)
    raise TypeError(
        "calibration: expected a Calibration or bench JSON path(s) from dpkit bench --json, "
        f"got {type(calibration).__name__}"
    )


def _gpu_hardware(devices: list[torch.device]) -> tuple[Hardware, str]:
    """The catalogue's entry for the GPU torch reports and its usual link; figures assumed when it has none."""
    catalogue = Catalogue.load()
    count = len(devices)
    name = torch.cuda.get_device_name(devices[0]) if torch.cuda.is_available() else "an unknown GPU"
    gpu = catalogue.match_gpu(name)
    if gpu is not None:
        link = catalogue.usual_link(gpu) or catalogue.link("pcie4")
        return Hardware(gpu, link), f"{count}x {gpu.name} ({name}), link {link.name} (its usual one)"
    memory = torch.cuda.get_device_properties(devices[0]).total_memory if torch.cuda.is_available() else 16 * 2**30
    assumed = GPU(
        name,
        {p: 20e12 for p in ("32", "tf32", "bf16-mixed", "16-mixed")},
        memory,
        1e12,
        "assumed: not in dpkit's catalogue (add it with a catalogue file)",
    )
    link = catalogue.link("pcie4")
    return Hardware(assumed, link), f"{count}x {name} (not in the catalogue: 20 TFLOPS and pcie4 assumed)"
