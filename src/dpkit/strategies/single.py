"""single: the whole global batch on one device; the reference every other strategy must equal."""

from __future__ import annotations

from typing import Sequence

import torch

from dpkit.strategies.base import Strategy


class Single(Strategy):
    name = "single"

    def __init__(self, devices: Sequence[torch.device]):
        if len(devices) != 1:
            raise ValueError(f"devices: strategy 'single' uses one device, got {len(devices)}; pass devices=1 or choose 'dp', 'replicated' or 'ddp'")
        super().__init__(devices)
