"""dpkit.DataParallel: scatter -> replicate -> parallel apply -> gather, on GPUs or virtual CPU devices."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from dpkit.devices import DeviceLike, parse_device, parse_device_list, tensor_on
from dpkit.parallel.apply import parallel_apply
from dpkit.parallel.gather import gather
from dpkit.parallel.replicate import replicate
from dpkit.parallel.scatter import batch_size_of, plan_split, scatter, unwrap_broadcasts


def check_chunk_sizes(chunk_sizes: Sequence[int] | None, n_devices: int) -> list[int] | None:
    if chunk_sizes is None:
        return None
    if isinstance(chunk_sizes, (str, bytes)) or not hasattr(chunk_sizes, "__len__"):
        raise TypeError(f"chunk_sizes: expected a list of row counts, one per device, got {chunk_sizes!r}")
    sizes = list(chunk_sizes)
    if len(sizes) != n_devices:
        raise ValueError(f"chunk_sizes: has {len(sizes)} entries for {n_devices} devices; give one row count per device")
    for i, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"chunk_sizes[{i}]: expected a non-negative int, got {size!r}")
    if sum(sizes) == 0:
        raise ValueError("chunk_sizes: all entries are 0; at least one device must receive rows")
    return sizes


class DataParallel(nn.Module):
    """Split each call's batch across devices, run one replica per device, gather the outputs.

    Args:
        module: the model; its parameters and buffers must live on the first device.
        device_ids: ints (CUDA indices), strings ("cuda:1", "cpu:3") or torch.device; None means every
            visible GPU. Virtual CPU devices come from `dpkit.cpu_devices(n)`.
        output_device: where outputs are gathered (default: the first device).
        dim: the batch dimension to split along.
        chunk_sizes: rows per device (must add up to the batch); 0 leaves a device out entirely.

    The wrapper's parameters are the module's own parameter objects and `state_dict()` keys carry a
    `module.` prefix as in torch; `dpkit.save_model` writes them without it.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[DeviceLike] | None = None,
                 output_device: DeviceLike | None = None, dim: int = 0, *,
                 chunk_sizes: Sequence[int] | None = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise ValueError(f"dim: expected a non-negative int batch dimension, got {dim!r}")
        self.module = module
        self.device_ids: list[torch.device] = parse_device_list(device_ids)
        self.output_device: torch.device = (
            self.device_ids[0] if output_device is None else parse_device(output_device, argument="output_device")
        )
        self.dim = dim
        self.chunk_sizes = check_chunk_sizes(chunk_sizes, len(self.device_ids))
        self.last_split_sizes: list[int] | None = None

    @property
    def primary_device(self) -> torch.device:
        return self.device_ids[0]

    def check_placement(self) -> None:
        """Every parameter and buffer must be on the primary device before any replica runs."""
        primary = self.primary_device
        for kind, named in (("parameter", self.module.named_parameters()), ("buffer", self.module.named_buffers())):
            for name, tensor in named:
                if not tensor_on(tensor, primary):
                    raise RuntimeError(
                        f"{kind} '{name}' is on {tensor.device} but DataParallel's primary device is {primary}; "
                        f"move the module there first (module.to('{primary}'))"
                    )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self.check_placement()
        batch_size = batch_size_of(inputs, kwargs, self.dim)
        if batch_size is None:  # nothing to split: run once on the primary device
            self.last_split_sizes = None
            args, kw = unwrap_broadcasts(inputs, kwargs, self.primary_device)
            return self.module(*args, **kw)
        plan = plan_split(batch_size, len(self.device_ids), self.chunk_sizes)
        self.last_split_sizes = list(plan.sizes)
        chunks = scatter(inputs, kwargs, plan, self.device_ids, self.dim)
        devices = [device for device, _, _ in chunks]
        replicas = replicate(self.module, devices, self.primary_device)
        outputs = parallel_apply(replicas, devices, [a for _, a, _ in chunks], [k for _, _, k in chunks])
        return gather(outputs, self.output_device, self.dim)

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.device_ids)
        return f"device_ids=[{devices}], output_device={self.output_device}, dim={self.dim}"
