"""The CUDA side of a report: the allocator's peak is the truth, dpkit's books give the categories."""

from __future__ import annotations

import torch


class AllocatorPeaks:
    """Resets the allocator's peak statistics at start and folds them into the report.

    The allocator's peak is process-wide, so only an observer started while no other runs may reset and
    report it (a nested one, e.g. balance's calibration, keeps to its own books)."""

    def __init__(self) -> None:
        self.owned = False

    def start(self, alone: bool) -> None:
        self.owned = alone and torch.cuda.is_available()
        if self.owned:
            for index in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(index)

    def fold_in(self, device: str, peak_bytes: int, by_category: dict[str, int]) -> int:
        """The device's peak, raised to the allocator's; what dpkit did not see is counted as "other"."""
        if not (self.owned and device.startswith("cuda")):
            return peak_bytes
        allocator_peak = torch.cuda.max_memory_allocated(int(device.split(":")[1]))
        if allocator_peak > peak_bytes:
            by_category["other"] += allocator_peak - peak_bytes
            return allocator_peak
        return peak_bytes
