"""Device specs: CUDA indices, "cuda:1", and virtual CPU devices "cpu:0" … "cpu:N-1".

`torch.device("cpu", i)` is a valid device whose tensors report plain `cpu`. dpkit treats each index
as a distinct device (one replica, one worker thread, one memory account), so every multi-device path
runs on a machine without a GPU.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence, Union

import torch

DeviceLike = Union[int, str, torch.device]


def parse_device(spec: DeviceLike, *, argument: str = "device") -> torch.device:
    """Turn an int (CUDA index), a string or a torch.device into a torch.device with an index."""
    if isinstance(spec, bool):  # bool is an int subclass; True is never a device
        raise TypeError(f"{argument}: expected an int, a string like 'cuda:1' or 'cpu:0', or a torch.device; got {spec!r}")
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"{argument}: CUDA index must be >= 0, got {spec}")
        return torch.device("cuda", spec)
    if isinstance(spec, str):
        try:
            device = torch.device(spec)
        except RuntimeError as error:
            raise ValueError(f"{argument}: {spec!r} is not a device; use 'cuda:1', 'cpu:0' or an int") from error
    elif isinstance(spec, torch.device):
        device = spec
    else:
        raise TypeError(f"{argument}: expected an int, a string like 'cuda:1' or 'cpu:0', or a torch.device; got {type(spec).__name__}")
    if device.index is None:
        device = torch.device(device.type, 0 if device.type == "cpu" else _current_index(device.type))
    return device


def _current_index(device_type: str) -> int:
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.current_device()
    return 0


def parse_device_list(device_ids: Iterable[DeviceLike] | None, *, argument: str = "device_ids") -> list[torch.device]:
    """Validate a device list: not empty, no duplicates, one device type."""
    if device_ids is None:
        return default_devices(argument=argument)
    if isinstance(device_ids, (str, int, torch.device)):
        raise TypeError(f"{argument}: expected a list of devices, got a single {type(device_ids).__name__} {device_ids!r}; wrap it in a list")
    devices = [parse_device(spec, argument=f"{argument}[{i}]") for i, spec in enumerate(device_ids)]
    if not devices:
        raise ValueError(f"{argument}: the device list is empty; give at least one device, e.g. dpkit.cpu_devices(2) or [0, 1]")
    seen: dict[torch.device, int] = {}
    for i, device in enumerate(devices):
        if device in seen:
            raise ValueError(f"{argument}: device {device} appears twice (positions {seen[device]} and {i}); each device may appear once")
        seen[device] = i
    types = sorted({device.type for device in devices})
    if len(types) > 1:
        raise ValueError(f"{argument}: mixed device types {types}; use only CUDA devices or only virtual CPU devices")
    return devices


def default_devices(*, argument: str = "device_ids") -> list[torch.device]:
    """Every visible GPU; without one, an error that says how to ask for virtual CPU devices."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    raise ValueError(
        f"{argument}=None means every visible GPU, and no GPU is visible. "
        "To run on virtual CPU devices pass device_ids=dpkit.cpu_devices(2) (or ['cpu:0', 'cpu:1'])."
    )


def cpu_devices(n: int) -> list[torch.device]:
    """The virtual CPU devices cpu:0 … cpu:n-1."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected a positive int number of virtual CPU devices, got {n!r}")
    return [torch.device("cpu", i) for i in range(n)]


def tensor_on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether a tensor lives on `device`; any CPU tensor counts as being on every virtual CPU device."""
    if tensor.device.type != device.type:
        return False
    if device.type == "cpu":
        return True
    return tensor.device.index == device.index


def detect_accelerator() -> str:
    """'cuda' when a GPU is visible, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"


def resolve_devices(accelerator: str = "auto", devices: int | Sequence[DeviceLike] | str = "auto") -> list[torch.device]:
    """The devices a command-line run or an Engine asks for, e.g. ("cpu", 2) -> [cpu:0, cpu:1]."""
    if accelerator not in ("auto", "cpu", "cuda"):
        raise ValueError(f"accelerator: expected 'auto', 'cpu' or 'cuda', got {accelerator!r}")
    if accelerator == "auto":
        accelerator = detect_accelerator()
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError("accelerator='cuda' but no GPU is visible; use accelerator='cpu' for virtual CPU devices")
    if isinstance(devices, str):
        if devices != "auto":
            if devices.isdigit():
                devices = int(devices)
            else:
                return parse_device_list(devices.split(","), argument="devices")
        else:
            devices = torch.cuda.device_count() if accelerator == "cuda" else 2
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(f"devices: expected a positive count, got {devices}")
        if accelerator == "cuda" and devices > torch.cuda.device_count():
            raise ValueError(f"devices={devices} but only {torch.cuda.device_count()} GPU(s) are visible")
        return [torch.device(accelerator, i) for i in range(devices)]
    return parse_device_list(devices, argument="devices")


def cpu_threads_per_device(n_devices: int) -> int:
    """torch intra-op threads for each of n virtual CPU devices, so they share the cores fairly."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, n_devices))


def tensor_device(tensor: torch.Tensor, virtual_cpu_device: DeviceLike) -> torch.device:
    """The device a tensor belongs to: its own, except that a CPU tensor, which reports plain `cpu`
    whatever virtual CPU device holds it, belongs to `virtual_cpu_device` (the one doing the work)."""
    if tensor.device.type == "cpu":
        return parse_device(virtual_cpu_device)
    return parse_device(tensor.device)
