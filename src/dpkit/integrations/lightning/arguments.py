"""What the Trainer's and Fabric's strategies accept: the modes (dpkit's strategies with one process and a
thread per device, asked of the registry's traits), their options, and the devices to run on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dpkit.devices import cpu_devices, parse_device_list
from dpkit.strategies import matching, strategy_class


def modes() -> list[str]:
    """dpkit's strategies with one process and a thread per device: the modes these strategies offer."""
    return matching(lambda traits: traits.threads_per_step)


def check_mode(mode: object) -> str:
    accepted = modes()
    if not isinstance(mode, str) or mode not in accepted:
        listed = ", ".join(repr(m) for m in accepted)
        raise ValueError(
            f"mode: expected one of {listed} (one process, a replica per device), got {mode!r}; "
            "for one process per device use Lightning's own strategy='ddp'"
        )
    return mode


def check_options(mode: str, options: Mapping[str, Any]) -> dict[str, Any]:
    known = strategy_class(mode).options
    for name in options:
        if name not in known:
            raise TypeError(f"{name}: not an option of mode {mode!r} (its options: {', '.join(known) or 'none'})")
    return dict(options)


def check_devices(devices: object) -> list[torch.device] | int | None:
    """devices as given to a strategy: a list of device specs, a count (devices of the accelerator Lightning
    chose), or None (Lightning's own devices= decides)."""
    if devices is None:
        return None
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(
                f"devices: expected a positive count, a list such as ['cpu:0', 'cpu:1'] or [0, 1], got {devices}"
            )
        return devices
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise TypeError(
            f"devices: expected a list such as ['cpu:0', 'cpu:1'] (virtual CPU devices) or [0, 1] (GPUs), a count, "
            f"or None, got {devices!r}"
        )
    return parse_device_list(devices, argument="devices")


def resolve_devices(
    asked: list[torch.device] | int | None, offered: Sequence[torch.device | str | int] | None
) -> list[torch.device]:
    """The devices to run on: `asked` (check_devices) completed with what Lightning's connector `offered` (its
    accelerator's devices for Trainer(devices=...)): a count takes the offered kind, None the offered count.
    Several CPU devices offered are virtual CPU devices cpu:0, cpu:1, ... Empty while nothing is known."""
    if isinstance(asked, list):
        return asked
    given = [torch.device(d) if not isinstance(d, torch.device) else d for d in (offered or [])]
    if not given:
        return []
    kind = given[0].type
    count = len(given) if asked is None else asked
    if asked is not None and len(given) > 1 and len(given) != asked:
        raise ValueError(
            f"devices: the strategy was given devices={asked} but Lightning's devices= gives {len(given)}; "
            "give the devices in one place"
        )
    if kind == "cpu":
        return cpu_devices(count)
    if asked is None:
        return parse_device_list(given, argument="devices")
    return parse_device_list([torch.device(kind, i) for i in range(count)], argument="devices")
