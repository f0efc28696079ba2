"""Per-device memory accounts: bytes now and at the peak, by category.

On virtual CPU devices all tensors report plain `cpu`, so dpkit keeps its own books: a dispatch mode
(`AllocationTracker`) sees every operator's outputs in the thread it is entered in, charges each newly
allocated storage to a (device, category) and holds a weak reference whose callback takes the storage
off the books when torch frees it. On CUDA the same books give the categories, and the device is the
tensor's own; the report's peak comes from the allocator (see observer.py).
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from dpkit.devices import parse_device, tensor_device

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "gathered_parameters",  # a sharded strategy's units gathered whole for their forward and backward (fsdp)
    "activations",
    "gathered_outputs",
    "loss",
    "other",
)


def is_dtensor(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether `tensor` is a DTensor, without importing torch.distributed.tensor (about 0.7 s of start-up for
    every process that measures memory): a DTensor exists only once that module is loaded."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def _storage_holder(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds the bytes: a DTensor's local shard (a DTensor itself reports a storage of
    the whole tensor's size, which this process does not hold)."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor


@dataclass
class DeviceAccount:
    """Live bytes by category on one device, the peak total and the breakdown at that peak."""

    current: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    total: int = 0
    peak_bytes: int = 0
    at_peak: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    category_peaks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))

    def add(self, category: str, nbytes: int) -> None:
        self.current[category] += nbytes
        self.total += nbytes
        if self.current[category] > self.category_peaks[category]:
            self.category_peaks[category] = self.current[category]
        if self.total > self.peak_bytes:
            self.peak_bytes = self.total
            self.at_peak = dict(self.current)

    def reset_peak(self) -> None:
        self.peak_bytes = self.total
        self.at_peak = dict(self.current)
        self.category_peaks = dict(self.current)


class MemoryLedger:
    """Which storage is charged to which device and category; thread-safe, forgets freed storages."""

    def __init__(self) -> None:
        # re-entrant: a weakref callback may fire inside our own critical section when we drop a reference
        self._lock = threading.RLock()
        self._entries: dict[int, tuple[str, str, int, weakref.ref]] = {}
        self._levels: dict[tuple[str, str], int] = {}  # bytes told by set_level, not seen as allocations
        self.accounts: dict[str, DeviceAccount] = {}

    def account(self, device: str) -> DeviceAccount:
        with self._lock:
            if device not in self.accounts:
                self.accounts[device] = DeviceAccount()
            return self.accounts[device]

    def charge(self, tensor: torch.Tensor, device: str, category: str) -> bool:
        """Put the tensor's storage on `device`'s books under `category` (no-op if already there)."""
        try:
            storage = _storage_holder(tensor).untyped_storage()
            key = storage._cdata
            nbytes = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less tensors
            return False
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[3]() is not None:
                return False
            ref = weakref.ref(storage, functools.partial(self._release, key))
            self._entries[key] = (device, category, nbytes, ref)
            self.account(device).add(category, nbytes)
            return True

    def move(self, tensor: torch.Tensor, device: str, category: str) -> None:
        """Re-home a storage (e.g. a replica's gradient that became the reduced .grad on device 0)."""
        try:
            storage = _storage_holder(tensor).untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        with self._lock:
            entry = self._entries.get(storage._cdata)
            if entry is None:
                self.charge(tensor, device, category)
                return
            old_device, old_category, nbytes, ref = entry
            if (old_device, old_category) == (device, category):
                return
            self.accounts[old_device].add(old_category, -nbytes)
            self._entries[storage._cdata] = (device, category, nbytes, ref)
            self.account(device).add(category, nbytes)

    def where(self, tensor: torch.Tensor) -> tuple[str, str] | None:
        """(device, category) a tensor's storage is charged to, or None if it is not on the books."""
        try:
            key = _storage_holder(tensor).untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return None
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else (entry[0], entry[1])

    def set_level(self, device: str, category: str, nbytes: int) -> None:
        """`device` now holds `nbytes` of `category` that no allocation shows: memory a strategy keeps in
        storages it resizes in place (fsdp's gathered parameters), told at each change."""
        with self._lock:
            before = self._levels.get((device, category), 0)
            self._levels[(device, category)] = nbytes
            if nbytes != before:
                self.account(device).add(category, nbytes - before)

    def _release(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[3] is not ref:  # the address was reused by a newer storage
                return
            del self._entries[key]
            self.accounts[entry[0]].add(entry[1], -entry[2])

    def reset_peaks(self) -> None:
        with self._lock:
            for account in self.accounts.values():
                account.reset_peak()


@functools.cache  # one entry per operator overload seen
def _fresh_returns(func: OpOverload) -> tuple[bool, ...]:
    """Per return value: True when the operator allocates it (it does not alias an input)."""
    return tuple(ret.alias_info is None for ret in func._schema.returns)


def fresh_tensors(func: OpOverload, out: Any) -> Iterator[torch.Tensor]:
    """The tensors an operator's call allocated: its outputs that do not alias an input."""
    fresh = _fresh_returns(func)
    if not any(fresh):
        return
    for is_fresh, value in zip(fresh, out if len(fresh) > 1 else (out,)):
        if not is_fresh:
            continue
        for tensor in value if isinstance(value, (tuple, list)) else (value,):  # Tensor[] returns too
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                yield tensor


def device_key(device: torch.device | str) -> str:
    """'cpu:3', 'cuda:0': the key of a device's account (a bare 'cpu' is cpu:0, as everywhere in dpkit)."""
    return str(parse_device(device))


@functools.cache  # called for every allocation while observing: parse each key once
def _parsed(key: str) -> torch.device:
    return parse_device(key)


def account_key(tensor: torch.Tensor, working_device: str) -> str:
    """The account a tensor is charged to: its own device's, or for a CPU tensor the virtual CPU device
    doing the work (devices.tensor_device)."""
    return str(tensor_device(tensor, _parsed(working_device)))


class AllocationTracker(TorchDispatchMode):
    """Charges every storage an operator allocates in this thread to `where()` -> (device, category).

    A CUDA tensor is charged to its own device; a CPU tensor (which reports plain `cpu`) to the
    device `where()` names, which is how virtual CPU devices get separate books.
    """

    def __init__(self, ledger: MemoryLedger, where: Callable[[], tuple[str, str]]):
        super().__init__()
        self.ledger = ledger
        self.where = where

    # torch.compile (issue 34): without this dynamo skips every frame entered under the mode, so replicas ran
    # eagerly. Caveat: a compiled graph's intermediate allocations (inside inductor's kernels) are not seen here.
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(
        self, func: OpOverload, types: Sequence[type], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in fresh_tensors(func, out):
            device, category = self.where()
            self.ledger.charge(tensor, account_key(tensor, device), category)
        return out
