"""What compressing the gradients changes in one step (Setup.compression, `dpkit plan --compress`): the bytes the
gradient exchange carries, how many collectives it takes, and the compression's own work on each device. The
formulas and their sources (Vogels et al. 2019; torch's ddp_comm_hooks) are in docs/cost-model.md, "Gradient
compression".

    wire_fraction(setup)         # the exchange's bytes over float32's: 1, 0.5 for bf16/fp16, PowerSGD's factors
    compression_seconds(setup, memory_rate, flops_rate, launch_seconds)   # the casts, or PowerSGD's work

PowerSGD compresses each weight matrix (rows x the rest) whose rank-R factors are at least twice smaller, and
all-reduces the other tensors whole, as torch's hook does; which matrices a model has comes from its profile
(ModelProfile.weight_matrices), or, when the profile has only totals, from gradient_matrices' approximation.
"""

from __future__ import annotations

import math

from dpkit.plan.configuration import Setup
from dpkit.plan.profiles import FP32_BYTES, ModelProfile
from dpkit.strategies import SHARDED
from dpkit.strategies.compression import Compression, powersgd_compresses

# torch's fp16/bf16 compress hook, per gradient element: the cast down (read 4 bytes, write 2), the division by the
# processes in place (2 + 2) and the copy back into the float32 bucket (2 + 4); three kernels per bucket
SIXTEEN_BIT_ALL_REDUCE_BYTES = 16
SIXTEEN_BIT_KERNELS_PER_BUCKET = 3
# a reduce-scatter in 16 bits (FSDP2's reduce_dtype): the unsharded gradient cast down (4 + 2), then its shard cast
# back (2 + 4); two kernels per unit
SIXTEEN_BIT_CAST_BYTES = 6
SIXTEEN_BIT_KERNELS_PER_UNIT = 2
# torch's powerSGD_hook, per bucket: the error fed back in (read the gradient and the error, write the sum), the copy
# kept to compute the next error (read, write) and that error (read both, write): 8 passes over the bucket's float32
# elements; then per compressed matrix three products, each reading or writing the matrix once (P = MQ, Q = M^T P,
# M = P Q^T), and two orthogonalizations of a factor (Q, warm-started, before its product; P after its all-reduce)
POWERSGD_BUCKET_PASSES = 8
POWERSGD_PRODUCTS = 3
POWERSGD_ORTHOGONALIZATIONS = 2
POWERSGD_KERNELS_PER_BUCKET = 6  # the error's add, copy and subtraction, the concatenation of the uncompressed tensors
# and their copy back, the division of Q
# one Gram-Schmidt (rank <= 2) launches per column a norm and a division, and for every column but the last a
# product, a sum, a product and a subtraction; QR (above rank 2, torch.linalg.qr) about this many (an estimate)
QR_KERNELS = 10
# the collectives of a bucket: one all-reduce, or PowerSGD's three, one after the other (the uncompressed tensors,
# then the P factors, then the Q factors)
POWERSGD_COLLECTIVES_PER_BUCKET = 3


def gradient_matrices(profile: ModelProfile) -> tuple[tuple[int, int, int], ...]:
    """The model's weight matrices as (rows, columns, how many): the profile's own (measured, or a built-in
    architecture's); else, from its totals, square matrices sharing the parameters evenly, one per weight-and-bias
    pair where the profile counts its tensors, else one per unit a sharded strategy gathers (the whole model when it
    has none): docs/cost-model.md says what this over- or understates."""
    if profile.weight_matrices:
        return profile.weight_matrices
    count = max(1, profile.parameter_tensors // 2) if profile.parameter_tensors else profile.units
    side = max(1, math.isqrt(max(1, profile.parameters // count)))
    return ((side, side, count),)


def compressed_matrices(profile: ModelProfile, rank: int) -> list[tuple[int, int, int, int]]:
    """(rows, columns, rank used, how many) of the matrices PowerSGD compresses at `rank`."""
    return [
        (rows, columns, min(rows, columns, rank), count)
        for rows, columns, count in gradient_matrices(profile)
        if powersgd_compresses((rows, columns), rank)
    ]


def powersgd_wire_bytes(profile: ModelProfile, rank: int) -> float:
    """The bytes PowerSGD all-reduces for the whole model: P and Q (rows + columns, times the rank, float32) of each
    matrix it compresses, and every other element whole."""
    matrices = compressed_matrices(profile, rank)
    compressed_elements = sum(rows * columns * count for rows, columns, _, count in matrices)
    factors = sum((rows + columns) * used * count for rows, columns, used, count in matrices)
    whole = max(0, profile.parameters - compressed_elements)
    return float(FP32_BYTES * (factors + whole))


def wire_fraction(setup: Setup) -> float:
    """The bytes the gradient exchange carries under the setup's compression, over what it carries in float32."""
    compression = setup.compression
    if not compression.compresses:
        return 1.0
    if compression.wire_dtype is not None:
        return 0.5
    return powersgd_wire_bytes(setup.profile, compression.rank) / setup.profile.parameter_bytes


def all_reduced_whole(compression: Compression) -> bool:
    """The compression exchanges low-rank factors, which only an all-reduce sums (no reduce-scatter can carry
    them): zero stage 1 then all-reduces as ddp does."""
    return compression.compresses and compression.wire_dtype is None


def collectives_per_bucket(compression: Compression) -> int:
    return POWERSGD_COLLECTIVES_PER_BUCKET if all_reduced_whole(compression) else 1


def compression_seconds(setup: Setup, memory_rate: float, flops_rate: float, launch_seconds: float) -> float:
    """One device's compression work per synchronizing step: what its kernels take on the device, and launching
    them on the host, which a GPU overlaps (the larger of the two shows) and virtual CPU devices add up. Nothing
    without compression or on one device."""
    compression = setup.compression
    if not compression.compresses or setup.processes <= 1:
        return 0.0
    if compression.wire_dtype is not None:
        device, kernels = sixteen_bit_work(setup, memory_rate)
    else:
        device, kernels = powersgd_work(setup, memory_rate, flops_rate)
    host = kernels * launch_seconds
    return device + host if setup.hardware.shared_compute else max(device, host)


def sixteen_bit_work(setup: Setup, memory_rate: float) -> tuple[float, int]:
    """(device seconds, kernels) of the casts: the compress hook's on whole gradients, bucket by bucket; a sharded
    strategy's on each unit's gradient before its reduce-scatter and on its shard after."""
    parameters = setup.profile.parameters
    if setup.traits.gradients == SHARDED:
        cast_bytes = SIXTEEN_BIT_CAST_BYTES * parameters * (1 + 1 / setup.shard_size)
        return cast_bytes / memory_rate, SIXTEEN_BIT_KERNELS_PER_UNIT * setup.profile.units
    buckets = setup.gradient_buckets
    return SIXTEEN_BIT_ALL_REDUCE_BYTES * parameters / memory_rate, SIXTEEN_BIT_KERNELS_PER_BUCKET * buckets


def orthogonalization_kernels(rank: int) -> int:
    return 6 * rank - 4 if rank <= 2 else QR_KERNELS


def powersgd_work(setup: Setup, memory_rate: float, flops_rate: float) -> tuple[float, int]:
    """(device seconds, kernels) of PowerSGD at the setup's rank: the error feedback's passes over every gradient
    element; per compressed matrix M (n x m, rank r) three products of 2nmr FLOPs, each at least a pass over M (at
    low rank they are bound by memory, not arithmetic), and two orthogonalizations of n x r and m x r factors
    (about 2(n + m)r^2 FLOPs)."""
    profile = setup.profile
    seconds = POWERSGD_BUCKET_PASSES * profile.parameter_bytes / memory_rate
    kernels = POWERSGD_KERNELS_PER_BUCKET * setup.gradient_buckets
    for rows, columns, rank, count in compressed_matrices(profile, setup.compression.rank):
        product_flops = 2 * rows * columns * rank
        product_bytes = FP32_BYTES * (rows * columns + (rows + columns) * rank)
        product = max(product_flops / flops_rate, product_bytes / memory_rate)
        orthogonalize = 2 * (rows + columns) * rank * rank / flops_rate
        seconds += count * (POWERSGD_PRODUCTS * product + orthogonalize)
        kernels += count * (POWERSGD_PRODUCTS + POWERSGD_ORTHOGONALIZATIONS * orthogonalization_kernels(rank))
    return seconds, kernels
