"""Device specs: CUDA indices, "cuda:1", and virtual CPU devices "cpu:0" … "cpu:N-1".

`torch.device("cpu", i)` is a valid device whose tensors report plain `cpu`. dpkit treats each index
as a distinct device (one replica, one worker thread, one memory account), so every multi-device path
runs on a machine without a GPU.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence

import torch

from dpkit.checks import check_int

DeviceLike = int | str | torch.device

# torch stores a device index in 8 signed bits: torch.device("cpu", 128) silently becomes cpu:-128 and
# torch.device("cpu", 256) becomes cpu:0, so two replicas would share one device
MAX_DEVICE_INDEX = 127
MAX_DEVICES = MAX_DEVICE_INDEX + 1
_DEVICE_SPEC = re.compile(r"^([a-z_]+)(?::(-?\d+))?$")
_HOW_TO_ASK_FOR_CPU = (
    "for virtual CPU devices use 'cpu:0', 'cpu:1', … (dpkit.cpu_devices(n), or accelerator=cpu devices=n)"
)


def _check_index(index: int, spec: object, argument: str) -> None:
    if index < 0:
        raise ValueError(f"{argument}: device index must be >= 0, got {spec!r}")
    if index > MAX_DEVICE_INDEX:
        raise ValueError(
            f"{argument}: device index {index} in {spec!r} is past torch's limit of {MAX_DEVICE_INDEX} "
            f"(a device index is 8 bits); use indices 0 … {MAX_DEVICE_INDEX}"
        )


def parse_device(spec: DeviceLike, *, argument: str = "device") -> torch.device:
    """Turn an int (CUDA index), a string or a torch.device into a torch.device with an index."""
    if isinstance(spec, bool):  # bool is an int subclass; True is never a device
        raise TypeError(
            f"{argument}: expected an int, a string like 'cuda:1' or 'cpu:0', or a torch.device; got {spec!r}"
        )
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"{argument}: CUDA index must be >= 0, got {spec}")
        _check_index(spec, spec, argument)
        return torch.device("cuda", spec)
    if isinstance(spec, str):
        # read the index before torch does: torch.device("cpu:300") wraps around to cpu:44 without a word
        match = _DEVICE_SPEC.match(spec.strip())
        if match and match.group(2) is not None:
            _check_index(int(match.group(2)), spec, argument)
        try:
            device = torch.device(spec.strip())
        except RuntimeError as error:
            raise ValueError(f"{argument}: {spec!r} is not a device; use 'cuda:1', 'cpu:0' or an int") from error
    elif isinstance(spec, torch.device):
        device = spec
        if device.index is not None and device.index < 0:  # made by torch.device(type, 128 … 255)
            raise ValueError(
                f"{argument}: {device} has a negative index (torch wrapped an index past "
                f"{MAX_DEVICE_INDEX} around); use indices 0 … {MAX_DEVICE_INDEX}"
            )
    else:
        raise TypeError(
            f"{argument}: expected an int, a string like 'cuda:1' or 'cpu:0', or a torch.device; "
            f"got {type(spec).__name__}"
        )
    if device.index is None:
        device = torch.device(device.type, 0 if device.type == "cpu" else _current_index(device.type))
    return device


def _current_index(device_type: str) -> int:
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.current_device()
    return 0


def _single_device_error(value: object, argument: str) -> TypeError:
    return TypeError(
        f"{argument}: expected a list of devices, got a single {type(value).__name__} {value!r}; wrap it in a list"
    )


def parse_device_list(device_ids: Iterable[DeviceLike] | None, *, argument: str = "device_ids") -> list[torch.device]:
    """Validate a device list: not empty, no duplicates, one device type."""
    if device_ids is None:
        return default_devices(argument=argument)
    if isinstance(device_ids, (str, int, torch.device)):
        raise _single_device_error(device_ids, argument)
    devices = [parse_device(spec, argument=f"{argument}[{i}]") for i, spec in enumerate(device_ids)]
    if not devices:
        raise ValueError(
            f"{argument}: the device list is empty; give at least one device, e.g. dpkit.cpu_devices(2) or [0, 1]"
        )
    seen: dict[torch.device, int] = {}
    for i, device in enumerate(devices):
        if device in seen:
            raise ValueError(
                f"{argument}: device {device} appears twice (positions {seen[device]} and {i}); "
                "each device may appear once"
            )
        seen[device] = i
    types = sorted({device.type for device in devices})
    if len(types) > 1:
        raise ValueError(f"{argument}: mixed device types {types}; use only CUDA devices or only virtual CPU devices")
    check_devices_exist(devices, argument=argument)
    return devices


def check_devices_exist(devices: Sequence[torch.device], *, argument: str = "device_ids") -> None:
    """A device list may only name GPUs this machine has (virtual CPU devices always exist)."""
    if len(devices) > MAX_DEVICES:
        raise ValueError(
            f"{argument}: {len(devices)} devices is past torch's limit of {MAX_DEVICES} per process "
            f"(a device index is 8 bits)"
        )
    for i, device in enumerate(devices):
        if device.type != "cuda":
            continue
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index >= visible:
            have = "no GPU is visible" if visible == 0 else f"only cuda:0 … cuda:{visible - 1} are visible"
            raise ValueError(
                f"{argument}[{i}]: {device} does not exist on this machine ({have}); {_HOW_TO_ASK_FOR_CPU}"
            )


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
    check_int(n, "n", meaning="number of virtual CPU devices")
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


def resolve_devices(
    accelerator: str = "auto",
    devices: int | Sequence[DeviceLike] | str = "auto",
    *,
    argument: str = "devices",
    accelerator_argument: str = "accelerator",
) -> list[torch.device]:
    """The devices a command-line run or an Engine asks for, e.g. ("cpu", 2) -> [cpu:0, cpu:1].

    A count is bounded by torch's 8-bit device index (at most 128 devices); a list must name devices of
    the accelerator asked for (a list of CUDA devices with accelerator="cpu" is an error, not a guess).
    """
    if accelerator not in ("auto", "cpu", "cuda"):
        raise ValueError(f"{accelerator_argument}: expected 'auto', 'cpu' or 'cuda', got {accelerator!r}")
    asked = accelerator
    if accelerator == "auto":
        accelerator = detect_accelerator()
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{accelerator_argument}='cuda' but no GPU is visible; "
            f"use {accelerator_argument}='cpu' for virtual CPU devices"
        )
    if isinstance(devices, str):
        if devices == "auto":
            devices = torch.cuda.device_count() if accelerator == "cuda" else 2
        elif devices.strip().lstrip("-").isdigit():
            devices = int(devices)
        else:
            # "0,1" names CUDA indices, as the ints of a device list do
            items = [int(item) if item.strip().isdigit() else item.strip() for item in devices.split(",")]
            devices = items
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(f"{argument}: expected a positive count, got {devices}")
        if devices > MAX_DEVICES:
            raise ValueError(
                f"{argument}: {devices} devices is past torch's limit of {MAX_DEVICES} per process "
                f"(a device index is 8 bits: cpu:0 … cpu:{MAX_DEVICE_INDEX}); ask for at most {MAX_DEVICES}"
            )
        if accelerator == "cuda" and devices > torch.cuda.device_count():
            raise ValueError(f"{argument}={devices} but only {torch.cuda.device_count()} GPU(s) are visible")
        return [torch.device(accelerator, i) for i in range(devices)]
    if isinstance(devices, bool):  # an int to Python, but not a count
        raise _single_device_error(devices, argument)
    if isinstance(devices, (list, tuple)) and asked != "auto":
        parsed = [parse_device(spec, argument=f"{argument}[{i}]") for i, spec in enumerate(devices)]
        if parsed and any(device.type != asked for device in parsed):
            listed = ",".join(str(spec) for spec in devices)
            raise ValueError(
                f"{argument}: {listed!r} names {parsed[0].type} devices but {accelerator_argument}={asked!r}; "
                + ("give a count (e.g. 2) or cpu:0,cpu:1" if asked == "cpu" else "give a count or cuda:0,cuda:1")
            )
    return parse_device_list(devices, argument=argument)


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_threads_per_device(n_devices: int) -> int:
    """torch intra-op threads for each of n virtual CPU devices, so they share the cores fairly."""
    return max(1, available_cores() // max(1, n_devices))


# more worker processes than this per core only thrash (each holds a copy of the model, a gloo mesh and
# the interpreter); a deliberate oversubscription is still possible with force
PROCESSES_PER_CORE = 4


def check_process_count(processes: int, *, argument: str = "nproc_per_node", force: bool = False) -> None:
    """Refuse a worker count far past the cores (ddp: one process per device) unless forced."""
    limit = PROCESSES_PER_CORE * available_cores()
    if processes > limit and not force:
        raise ValueError(
            f"{argument}: {processes} processes on {available_cores()} CPU core(s) is past the limit of "
            f"{limit} ({PROCESSES_PER_CORE} per core); ask for fewer, or pass force=True to start them anyway"
        )


def tensor_device(tensor: torch.Tensor, virtual_cpu_device: DeviceLike) -> torch.device:
    """The device a tensor belongs to: its own, except that a CPU tensor, which reports plain `cpu`
    whatever virtual CPU device holds it, belongs to `virtual_cpu_device` (the one doing the work)."""
    if tensor.device.type == "cpu":
        return parse_device(virtual_cpu_device)
    return parse_device(tensor.device)


# --- host memory for virtual CPU devices ----------------------------------------------------------------
# glibc's malloc hands every block over 128 KiB back to the kernel when it is freed (it raises that limit
# as it sees larger blocks, up to twice a freed block for trimming). A training step frees and allocates
# the same activations and gradients every time, so each step page-faults them in again and the kernel
# zeroes them; several replica threads, each with its own malloc arena, pay it once per replica. Measured
# on an MLP 3x1536, batch 256 per replica, one thread: backward 53 ms -> 45 ms with freed blocks kept.
# Keeping them is what PyTorch's CUDA caching allocator does on GPUs, and what jemalloc/tcmalloc do when
# preloaded for CPU training.
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit: larger blocks stay mmapped
TRIM_THRESHOLD_BYTES = 1 << 30  # free memory a malloc heap keeps at its top before giving it back
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_USER_ALLOCATOR_SETTINGS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "GLIBC_TUNABLES",
    "LD_PRELOAD",
)
HOST_MEMORY_ENV = "DPKIT_KEEP_HOST_MEMORY"  # "0" leaves malloc as it is
_host_memory_kept: bool | None = None


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc keep freed blocks up to 32 MiB for reuse instead of returning them to the kernel
    (process-wide; once). Returns whether it is in effect.

    Left alone (False) when not on glibc, when DPKIT_KEEP_HOST_MEMORY=0, or when the user already chose
    malloc's behaviour (MALLOC_*_ environment variables, GLIBC_TUNABLES, or a preloaded allocator). The
    price is resident memory: up to TRIM_THRESHOLD_BYTES of freed memory per malloc arena stays with the
    process, as a caching allocator's pool does.
    """
    global _host_memory_kept
    if _host_memory_kept is not None:
        return _host_memory_kept
    _host_memory_kept = False
    if os.environ.get(HOST_MEMORY_ENV, "1") == "0" or any(os.environ.get(name) for name in _USER_ALLOCATOR_SETTINGS):
        return False
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # setting either switches off glibc's dynamic adjustment of both; a fixed trim threshold alone (with the
    # mmap threshold back at 128 KiB) would be worse than nothing, so the mmap threshold goes first
    _host_memory_kept = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    return _host_memory_kept
