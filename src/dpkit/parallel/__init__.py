"""The single-process data-parallel engine: one verb per module.

torch.nn.parallel's verbs are here with torch's names and signatures (data_parallel, replicate, scatter,
scatter_kwargs, parallel_apply, gather), so torch code runs by changing the import.
"""

from dpkit.parallel.data_parallel import DataParallel
from dpkit.parallel.functional import data_parallel, gather, parallel_apply, replicate, scatter, scatter_kwargs
from dpkit.parallel.scatter import Broadcast, split_sizes

__all__ = [
    "Broadcast",
    "DataParallel",
    "data_parallel",
    "gather",
    "parallel_apply",
    "replicate",
    "scatter",
    "scatter_kwargs",
    "split_sizes",
]
