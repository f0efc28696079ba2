"""Measuring: per-device memory by category, time by phase, reports and traces.

    with dpkit.observe.Observer() as obs:
        step()
    print(obs.report().format_table())
"""

from dpkit.observe.memory import CATEGORIES, AllocationTracker, MemoryLedger
from dpkit.observe.observer import Observer, active, replica_phase
from dpkit.observe.report import DeviceReport, Report
from dpkit.observe.timing import PHASES

__all__ = ["CATEGORIES", "PHASES", "AllocationTracker", "DeviceReport", "MemoryLedger", "Observer", "Report",
           "active", "replica_phase"]
