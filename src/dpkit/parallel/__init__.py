"""The single-process data-parallel engine: one verb per module."""

from dpkit.parallel.data_parallel import DataParallel
from dpkit.parallel.scatter import Broadcast, split_sizes

__all__ = ["Broadcast", "DataParallel", "split_sizes"]
