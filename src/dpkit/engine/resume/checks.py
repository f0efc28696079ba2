"""Loading a training state: the checks made before anything changes, and the undo of what changed.

load_state is all or nothing: every optimizer's class, param groups and per-parameter state, and every
named object's kind, are refused here before anything is loaded; what a load_state_dict still refuses is
put back by Undo.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from dpkit.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from dpkit.checkpoint.model_files import check_state_dict
from dpkit.checkpoint.state import kind_of, same_kind, short_kind
from dpkit.strategies.replica_optimizers import ELEMENTWISE

log = logging.getLogger("dpkit")


class Stateful(Protocol):
    """What a load changes and can put back: a model, an optimizer, a strategy, a scheduler given by name."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any], /) -> object: ...


def check_optimizer_class(index: int, optimizer: torch.optim.Optimizer, saved_class: str | None) -> None:
    """Refuse the state of another optimizer class (Adam's moments into SGD) before anything changes."""
    here = kind_of(getattr(optimizer, "user", optimizer))
    if saved_class is not None and same_kind(saved_class, here) is False:
        raise CheckpointMismatchError(
            f"optimizer {index}: the state was saved from {short_kind(saved_class)}, this engine set up "
            f"{short_kind(here)}; build the optimizer as in the saved run. Nothing was loaded"
        )


def check_optimizer_state(index: int, optimizer: Any, saved: dict[str, Any]) -> None:
    """Refuse per-parameter state that does not fit the optimizer's parameters, before anything changes: an
    entry for a parameter it does not have, or (for an elementwise optimizer such as SGD or Adam) a state
    tensor of another shape than its parameter."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    state = saved.get("state", {})
    if not isinstance(state, Mapping):
        raise CheckpointCorruptError(f"optimizer {index}: its saved state is a {type(state).__name__}, not a dict")
    elementwise = isinstance(getattr(optimizer, "user", optimizer), ELEMENTWISE)
    wrong = []
    for key, entry in state.items():
        if not isinstance(key, int) or not 0 <= key < len(params) or not isinstance(entry, Mapping):
            wrong.append(f"an entry {key!r} for none of its {len(params)} parameters")
            continue
        shape = tuple(params[key].shape)
        for name, value in entry.items():
            if (
                elementwise
                and isinstance(value, torch.Tensor)
                and value.dim() > 0
                and value.numel() > 1
                and tuple(value.shape) != shape
            ):
                wrong.append(f"parameter {key}'s {name}: state {tuple(value.shape)} vs parameter {shape}")
    if wrong:
        shown = "; ".join(wrong[:8]) + (f"; and {len(wrong) - 8} more" if len(wrong) > 8 else "")
        raise CheckpointMismatchError(
            f"optimizer {index}: its saved state does not fit this optimizer's parameters ({shown}); build the "
            "model and optimizer as in the saved run. Nothing was loaded"
        )


def check_named_object(name: str, target: Any, extras: Mapping[str, Any], source: Any) -> None:
    """Refuse an object passed to load_state by name that the state does not hold, or holds for another kind
    of object (a StepLR's state given to a CosineAnnealingLR), before anything changes."""
    if name not in extras:
        raise CheckpointMismatchError(
            f"{name}: not in the saved state's extras ({', '.join(sorted(extras)) or 'none'}); pass by name only the "
            f"objects saved with engine.save_state(..., {name}=...). Nothing was loaded"
        )
    entry = extras[name]
    if entry.get("kind") != "state_dict" or not callable(getattr(target, "load_state_dict", None)):
        raise TypeError(
            f"{name}: saved as a plain value; it comes back in load_state's result, not through load_state_dict"
        )
    saved_class, here = entry.get("class"), kind_of(target)
    if saved_class is not None and same_kind(saved_class, here) is False:
        raise CheckpointMismatchError(
            f"{name}: the state was saved from {short_kind(saved_class)}, given {short_kind(here)}; pass the same "
            "kind of object as in the saved run. Nothing was loaded"
        )
    if isinstance(target, nn.Module):
        check_state_dict(target, entry["value"], f"{name} (saved in {source})")


def optimizer_snapshot(optimizer: Any) -> dict[str, Any]:
    """A copy of the optimizer's state dict to put back with load_state_dict: plain tensors copied to the CPU
    (load_state_dict moves them to their parameters' devices), so that a copy costs no device memory."""

    def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
        if type(tensor) is torch.Tensor:
            return tensor.detach().to("cpu", copy=True)
        return tensor.detach().clone()  # a DTensor: its local shard, where it is

    return tree_map_only(torch.Tensor, copy_tensor, optimizer.state_dict())


class Undo:
    """What load_state changed so far, each with its state from before, put back when a later step fails."""

    def __init__(self) -> None:
        self.changed: list[tuple[str, Stateful, dict[str, Any]]] = []
        self.step = "the state"  # what is being loaded now, for the message

    def keep(self, what: str, target: Stateful, before: dict[str, Any]) -> None:
        self.changed.append((what, target, before))
        self.step = what

    def back(self, error: Exception, chosen: Path) -> Exception:
        """Put everything back; the error to raise (the same one unless it is a refusal of the saved state)."""
        not_back = []
        for what, target, before in reversed(self.changed):
            try:
                target.load_state_dict(before)
            except Exception as undo_error:  # noqa: BLE001 - say it, and go on putting back the others
                not_back.append(f"{what} ({undo_error})")
        partly = self.step in ("the model", "the sharded model and optimizers")
        if not_back or partly:
            held = ", ".join(not_back) if not_back else self.step
            log.error("engine.load_state: %s may now hold part of the saved state from %s", held, chosen)
        if isinstance(error, torch.cuda.OutOfMemoryError) or not isinstance(
            error, (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError)
        ):
            return error
        if partly or not_back:
            outcome = f"{', '.join(not_back) if not_back else self.step} may hold part of it"
        else:
            outcome = (
                "nothing was loaded: the model, optimizers, objects, engine.step, loaders and generators are as "
                "they were"
            )
        return CheckpointMismatchError(
            f"{self.step}: loading its saved state from {chosen} failed ({type(error).__name__}: {error}); "
            f"{outcome}. Pass the same kind of object, built as in the saved run"
        )
