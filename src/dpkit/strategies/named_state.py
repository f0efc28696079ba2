"""Optimizer states keyed by parameter names, as torch.distributed.checkpoint.state_dict reads and writes them
for sharded models, and their conversion to and from the numbering of optimizer.state_dict(), which every
strategy resumes from. Not a strategy: a helper fsdp and the training state share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def numbered_optimizer_state(by_name: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter names (as torch.distributed.checkpoint.state_dict writes it)
    numbered as optimizer.state_dict() numbers it: parameters in param_groups order."""
    groups = by_name.get("param_groups", [])
    number = {name: index for index, name in enumerate(name for group in groups for name in group["params"])}
    return {
        "state": {number[name]: value for name, value in by_name.get("state", {}).items()},
        "param_groups": [{**group, "params": [number[name] for name in group["params"]]} for group in groups],
    }


def named_optimizer_state(numbered: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse: `names[i]` is the name of the optimizer's parameter number i."""
    return {
        "state": {names[index]: value for index, value in numbered["state"].items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]} for group in numbered["param_groups"]
        ],
    }
