"""The cost model's numbers that are not the hardware's: what a strategy keeps and moves per parameter (fixed by
how PyTorch implements it), and CostConstants, the host's and the step's figures a calibration fits.

Their sources are in docs/cost-model.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dpkit.plan.profiles import FP32_BYTES

OPTIMIZER_STATE_BYTES_PER_PARAMETER = {"adam": 8, "adamw": 8, "sgd": 4}  # Adam(W): two moments; SGD: momentum
# Parameters and gradients are float32 under every precision (autocast keeps them so; the sharded strategy's
# shards and their gradients are float32 too): with Adam 4 + 4 + 8 = 16 bytes per parameter, the same 16 as
# ZeRO's 2 + 2 + 12 for mixed precision (Rajbhandari et al. 2020, section 3.1), which counts the float32
# master copy with the optimizer state and 16-bit parameters and gradients instead.
# Under mixed precision autocast also keeps a 16-bit copy of every weight a matmul or convolution uses, from
# the cast in forward until backward has used it (saved for backward): 2 bytes per parameter, unsharded.
AUTOCAST_COPY_BYTES_PER_PARAMETER = 2
# A sharded strategy (fsdp: FSDP2 with MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) under
# bf16-mixed) gathers each unit's parameters in 16 bits under mixed precision (4 bytes otherwise), computes the
# unit's whole gradient in that dtype and reduce-scatters it in float32.
REDUCE_SCATTER_BYTES_PER_PARAMETER = FP32_BYTES
PREFETCHED_UNITS = 1  # FSDP2 keeps one more unit's all-gather in flight, in forward and in backward
SHARDED_KERNELS_PER_COLLECTIVE = 3  # per unit and collective: copy-in, the collective, copy-out
# bytes an optimizer step reads and writes per fp32 parameter with PyTorch's default (unfused, for-each)
# implementations, which make one pass over memory per elementwise operation: Adam's lerp, mul, addcmul,
# sqrt, div, add and addcdiv read 12 and write 7 tensors; AdamW decays the weights first (a mul: one more read
# and write); SGD with momentum's mul, add, add read 5 and write 3
OPTIMIZER_TRAFFIC_BYTES_PER_PARAMETER = {"adam": 76, "adamw": 84, "sgd": 32}


@dataclass(frozen=True)
class CostConstants:
    """What the hardware's data sheet does not say; `dpkit plan --calibration` fits them to a bench run."""

    compute_efficiency: float = 0.45  # achieved / peak dense FLOP/s of a training step
    # host time to launch one kernel from eager PyTorch; on a GPU of the catalogue its own figure
    # (hardware.json's launch_seconds) is used instead, unless a calibration fitted this one
    launch_seconds: float = 6e-6
    step_overhead_seconds: float = 1e-3  # the Python of one step outside the kernels
    thread_seconds: float = 60e-6  # handing the replicas' threads their jobs and joining them (dp, replicated)
    # DataParallel re-makes its replicas at every step, in Python, in the calling thread: per module of each
    # replica (a new module object, its dicts copied) and per parameter tensor of each replica (the alias or
    # copy, its autograd edge back to the original)
    module_seconds: float = 8e-6
    tensor_seconds: float = 4e-6
    # how one process's replica threads serialise on Python's GIL: N threads launching L seconds' worth of kernels
    # each take at least N x gil_share x L together (1: taking turns; above 1: contending for the GIL costs more
    # than taking turns). 1.5 is about what benchmarks/launch_bound_prediction.py fits on virtual CPU devices
    # (1.5 to 2.3 on a 2-core machine); a calibration fits it for the machine at hand
    gil_share: float = 1.5
    bucket_bytes: int = 25 * 2**20  # DDP's default bucket_cap_mb
    # host time of a sharded unit's hooks, once in forward and once in backward (FSDP2's pre/post-forward and
    # pre/post-backward: copy-in, waits, copy-out): an estimate, see docs/cost-model.md
    unit_seconds: float = 100e-6
    memory_headroom: float = 0.9  # usable fraction of device memory (allocator, CUDA context)
    source: str = "defaults (docs/cost-model.md)"
    fitted: tuple[str, ...] = ()  # the constants a calibration fitted: they win over the catalogue's figures

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["fitted"] = list(self.fitted)
        return data
