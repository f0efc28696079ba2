"""Run replicas side by side, one persistent worker thread per device.

Each replica's thread inherits the caller's grad mode, inference mode and full autocast state (enabled
and dtype), gets its device and stream made current, and on virtual CPU devices a fair share of torch's
intra-op threads and its own generator. An error in a replica is re-raised in the caller with its type,
the replica index and device in the message, and the original chained; every replica is waited for, so
nothing hangs and the wrapper stays usable.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from dpkit.devices import cpu_threads_per_device
from dpkit.parallel import hooks
from dpkit.parallel.replica_rng import ReplicaGenerator, generator_for, replica_seeds
from dpkit.parallel.streams import current_stream, device_context

_workers: dict[str, ThreadPoolExecutor] = {}
_workers_lock = threading.Lock()


def worker_for(device: torch.device) -> ThreadPoolExecutor:
    """The one worker thread of a device, created on first use and kept for the process."""
    key = str(device)
    with _workers_lock:
        if key not in _workers:
            _workers[key] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dpkit-{key}")
        return _workers[key]


@dataclass(frozen=True)
class CallerContext:
    """The thread-local autograd and autocast state of the caller, to re-enter in worker threads."""

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool

    @classmethod
    def capture(cls) -> "CallerContext":
        states = []
        for device_type in ("cpu", "cuda"):
            enabled = torch.is_autocast_enabled(device_type)
            if enabled:
                states.append((device_type, True, torch.get_autocast_dtype(device_type)))
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), tuple(states),
                   torch.is_autocast_cache_enabled())

    def enter(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.inference_mode:
            stack.enter_context(torch.inference_mode())
        else:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        for device_type, enabled, dtype in self.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache))
        return stack


def _rethrow(index: int, device: torch.device, error: BaseException) -> None:
    message = f"in replica {index} on device {device}: {type(error).__name__}: {error}"
    try:
        wrapped = type(error)(message)
    except Exception:  # exception types whose constructor takes other arguments
        wrapped = RuntimeError(message)
    raise wrapped from error


def _run_one(index: int, replica: nn.Module, device: torch.device, args: tuple, kwargs: dict,
             context: CallerContext, stream: Any, seed: int | None, threads: int | None) -> Any:
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    with contextlib.ExitStack() as stack:
        stack.enter_context(device_context(device, stream))
        stack.enter_context(context.enter())
        if seed is not None:
            stack.enter_context(ReplicaGenerator(generator_for(seed)))
        stack.enter_context(hooks.replica(index, device))
        return replica(*args, **kwargs)


def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[tuple], kwargs_tup: Sequence[dict] | None = None,
                   devices: Sequence[torch.device] | None = None) -> list[Any]:
    """Outputs of replica i on inputs[i], kwargs_tup[i], in replica order (torch's signature)."""
    kwargs = [{} for _ in replicas] if kwargs_tup is None else kwargs_tup
    if devices is None:
        raise ValueError("devices: parallel_apply needs the device of every replica (virtual CPU devices cannot be inferred)")
    if not (len(replicas) == len(devices) == len(inputs) == len(kwargs)):
        raise ValueError(f"parallel_apply: {len(replicas)} replicas, {len(devices)} devices, {len(inputs)} inputs, {len(kwargs)} kwargs; they must match")
    context = CallerContext.capture()
    streams = [current_stream(device) for device in devices]
    on_cpu = all(device.type == "cpu" for device in devices)
    n = len(replicas)
    if n == 1:
        try:
            return [_run_one(0, replicas[0], devices[0], inputs[0], kwargs[0], context, streams[0], None, None)]
        except Exception as error:
            _rethrow(0, devices[0], error)
    seeds = replica_seeds(n) if on_cpu else [None] * n
    threads = cpu_threads_per_device(n) if on_cpu else None
    futures = [
        worker_for(device).submit(_run_one, i, replica, device, args, kw, context, stream, seed, threads)
        for i, (replica, device, args, kw, stream, seed) in enumerate(zip(replicas, devices, inputs, kwargs, streams, seeds))
    ]
    outputs, first_error = [], None
    for i, future in enumerate(futures):  # wait for all, so no replica is left running
        try:
            outputs.append(future.result())
        except BaseException as error:
            outputs.append(None)
            if first_error is None:
                first_error = (i, error)
    if first_error is not None:
        _rethrow(first_error[0], devices[first_error[0]], first_error[1])
    return outputs
