"""Measuring: per-device memory by category, time by phase, reports and traces.

    with dpkit.observe.Observer() as obs:
        step()
    print(obs.report().format_table())

A started Observer listens to the observation seam (dpkit.parallel.hooks), where DataParallel and every
strategy announce their phases; measured_balance.py measures the steps of DataParallel(balance=...).
"""

from dpkit.observe import measured_balance  # plugs the measured balance into the seam
from dpkit.observe.memory import CATEGORIES, AllocationTracker, MemoryLedger
from dpkit.observe.observer import Observer, active
from dpkit.observe.report import DeviceReport, Report
from dpkit.observe.timing import PHASES
from dpkit.parallel.hooks import replica_phase  # inside a replica's job: switch its phase for every listener

__all__ = [
    "CATEGORIES",
    "PHASES",
    "AllocationTracker",
    "DeviceReport",
    "MemoryLedger",
    "Observer",
    "Report",
    "active",
    "measured_balance",
    "replica_phase",
]
