"""What the cost model needs to know about a model: its size, its work per sample, its kernels.

A profile comes from one of three places:
- `measure_model(factory, input_shape)`: the model is built on the meta device (no memory, no weights)
  and one forward and backward is traced: FLOPs with torch's FlopCounterMode, kernels as the non-view
  aten operators dispatched, activation bytes as what autograd saves for backward;
- `builtin_profile(name, input_shape=..., seq_len=...)`: published numbers for models too big for this
  machine, scaled to the input size asked for;
- `ModelProfile(...)` with the numbers given directly (`dpkit plan --params ... --flops-per-sample ...`).
All FLOP and byte counts are per sample of one forward pass, in fp32 (4-byte) terms.

A strategy that shards the weights (fsdp) gathers the model's parameters one unit at a time; the profile says how
many units and how many parameters the largest holds (`largest_unit_parameters`, `shard_units`), following the
sharding strategies' default rule (dpkit.strategies.units, read without importing a strategy): every block of an
nn.ModuleList (whole) and every other module with at least a million parameters of its own is a unit, the root
holds the rest (`shard_unit_sizes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn
from torch._ops import OpOverload

from dpkit.strategies.units import DEFAULT_UNIT_PARAMETERS, shard_unit_sizes

FP32_BYTES = 4
# a transformer block's modules as Hugging Face's GPT-2 builds it (two layer norms, attention with its two
# projections and two dropouts, the MLP with its two projections, activation and dropout); the model adds about 8
MODULES_PER_BLOCK = 13
UNIT_MIN_PARAMETERS = DEFAULT_UNIT_PARAMETERS  # the sharded strategy's default: a module this large is a unit


@dataclass(frozen=True)
class ModelProfile:
    name: str
    parameters: int  # trainable parameter count
    flops_per_sample: float  # forward pass; backward costs twice this
    kernels_per_forward: int  # operators that launch work (what the host pays per launch)
    activation_bytes_per_sample: float  # saved for backward (fp32)
    output_bytes_per_sample: float  # what DataParallel gathers on device 0 (fp32)
    input_bytes_per_sample: float  # what DataParallel scatters from device 0
    parameter_tensors: int = 0  # tensors replicated / bucketed (0: unknown)
    source: str = ""
    # sharded strategies: the most parameters one unit gathers at once, and how many units there are
    # (0: unknown; then the whole model counts as one unit, the most a sharded strategy could gather)
    largest_unit_parameters: int = 0
    shard_units: int = 0
    # modules in the model, the root included (model.modules()): what DataParallel re-makes in Python for every
    # replica at every step (0: unknown; then estimated from the parameter tensors)
    modules: int = 0
    # the weight matrices gradient compression sees, as (rows, columns, how many): every trainable parameter of two
    # or more dimensions viewed as its first dimension by the rest, as torch's PowerSGD hook views it; the other
    # parameters are vectors (empty: unknown; plan/compression_cost.py approximates them then)
    weight_matrices: tuple[tuple[int, int, int], ...] = ()

    @property
    def module_count(self) -> int:
        """Modules a replica re-makes: the measured count, or about one per weight and bias pair plus the root."""
        if self.modules:
            return self.modules
        return max(1, self.parameter_tensors // 2 + 1) if self.parameter_tensors else 1

    @property
    def parameter_bytes(self) -> int:
        return self.parameters * FP32_BYTES

    @property
    def unit_parameters(self) -> int:
        """Parameters of the largest unit a sharded strategy gathers (the whole model when unknown)."""
        return min(self.largest_unit_parameters, self.parameters) if self.largest_unit_parameters else self.parameters

    @property
    def units(self) -> int:
        """Units a sharded strategy gathers one after another (at least enough to hold every parameter)."""
        if self.shard_units:
            return self.shard_units
        return max(1, -(-self.parameters // self.unit_parameters))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        if "weight_matrices" in known:  # JSON's lists back to the frozen value's tuples
            known["weight_matrices"] = tuple(tuple(int(n) for n in entry) for entry in known["weight_matrices"])
        return cls(**known)


def matrix_counts(parameters: Sequence[torch.Tensor]) -> tuple[tuple[int, int, int], ...]:
    """ModelProfile.weight_matrices of these parameters: (rows, columns, how many) of those with two or more
    dimensions, each viewed as its first dimension by the rest."""
    counts: dict[tuple[int, int], int] = {}
    for parameter in parameters:
        if parameter.dim() >= 2:
            rows = int(parameter.shape[0])
            shape = (rows, int(parameter.numel()) // max(1, rows))
            counts[shape] = counts.get(shape, 0) + 1
    return tuple((rows, columns, count) for (rows, columns), count in sorted(counts.items()))


# ---- measuring a model ----------------------------------------------------------------------------


class _KernelCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts dispatched aten operators that do work (views and metadata-only operators launch nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(
        self, func: OpOverload, types: Sequence[type], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if not func.is_view and func.__name__.split(".")[0] not in ("detach", "alias", "lift_fresh", "_to_copy"):
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` on the meta device, made without copying its weights (each parameter and buffer is
    replaced by a meta tensor of its shape before the deep copy reaches it)."""
    import copy

    memo: dict[int, torch.Tensor] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in memo:
            continue
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _tensor_bytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


def measure_model(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    input_shape: Sequence[int],
    *,
    input_dtype: torch.dtype = torch.float32,
    name: str = "model",
    batch: int = 2,
    device: str = "meta",
) -> ModelProfile:
    """Trace one forward and backward of `batch` samples of shape `input_shape` and count per sample.

    `device="meta"` builds a factory's model without memory; an nn.Module given directly is measured
    on a meta copy (its weights are not touched). Integer `input_dtype` draws token ids below 2.
    """
    from torch.utils.flop_counter import FlopCounterMode

    if isinstance(model_or_factory, nn.Module):
        model = model_or_factory
        if device == "meta":
            model = meta_copy(model)
    else:
        with torch.device(device):
            model = model_or_factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model factory: returned {type(model).__name__}, expected a torch.nn.Module")
    shape = [batch, *(int(s) for s in input_shape)]
    if input_dtype.is_floating_point:
        x = torch.randn(shape, device=device, dtype=input_dtype)
    else:
        x = torch.randint(0, 2, shape, device=device, dtype=input_dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    saved = {"bytes": 0}
    seen: set[int] = set()
    parameter_ids = {id(p) for p in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # parameters (and views of them, such as a transposed weight) saved for backward are not
        # activations; count each saved tensor once
        base = tensor._base if tensor._base is not None else tensor
        if id(tensor) not in seen and id(base) not in parameter_ids and id(tensor) not in parameter_ids:
            seen.add(id(tensor))
            saved["bytes"] += tensor.numel() * tensor.element_size()
        return tensor

    units = shard_unit_sizes(model)
    counter = _KernelCounter()
    flops = FlopCounterMode(display=False)
    with flops:
        with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = model(x)
        forward_flops = flops.get_total_flops()
        forward_kernels = counter.kernels
        loss = sum(o.float().sum() for o in (output if isinstance(output, (list, tuple)) else [output]))
        if loss.requires_grad:
            loss.backward()
    return ModelProfile(
        name=name,
        parameters=sum(p.numel() for p in trainable),
        flops_per_sample=forward_flops / batch,
        kernels_per_forward=forward_kernels,
        activation_bytes_per_sample=saved["bytes"] / batch,
        output_bytes_per_sample=_tensor_bytes(output) / batch,
        input_bytes_per_sample=x.numel() * x.element_size() / batch,
        parameter_tensors=len(trainable),
        source=f"measured on the {device} device with FlopCounterMode (input {tuple(input_shape)})",
        largest_unit_parameters=max(units, default=0),
        shard_units=len(units),
        modules=len(list(model.modules())),
        weight_matrices=matrix_counts(trainable),
    )


# ---- built-in profiles ----------------------------------------------------------------------------


def _cnn(
    name: str,
    parameters: float,
    macs_224: float,
    kernels: int,
    activation_bytes_224: float,
    tensors: int,
    source: str,
    largest_unit: int = 0,
    units: int = 0,
    modules: int = 0,
) -> Callable[..., ModelProfile]:
    """A convolutional net whose work and activations scale with the image area; `largest_unit` and `units`
    as the sharded strategy's default rule cuts it (`shard_unit_sizes` of the torchvision architecture);
    `modules`: the torchvision architecture's len(list(model.modules()))."""

    def build(input_shape: Sequence[int] | None = None, seq_len: int | None = None) -> ModelProfile:
        shape = tuple(input_shape) if input_shape else (3, 224, 224)
        if len(shape) != 3:
            raise ValueError(
                f"input_shape: {name} takes channels,height,width such as 3,224,224, got {','.join(map(str, shape))}"
            )
        area = shape[1] * shape[2] / (224 * 224)
        return ModelProfile(
            name,
            int(parameters),
            2 * macs_224 * area,
            kernels,
            activation_bytes_224 * area,
            1000 * FP32_BYTES,
            math.prod(shape) * FP32_BYTES,
            tensors,
            source + f"; scaled to input {shape}",
            largest_unit,
            units,
            modules,
        )

    return build


def _transformer(
    name: str,
    parameters: float,
    layers: int,
    width: int,
    vocab: int,
    default_seq: int,
    heads: int,
    source: str,
    tied: bool = True,
) -> Callable[..., ModelProfile]:
    """A transformer: forward FLOPs per token 2N + 2*layers*seq*width (Kaplan et al. 2020, Table 1),
    activations per layer and sample seq*width*(34 + 5*heads*seq/width) bytes in 16-bit (Korthikanti et
    al. 2022, eq. 1), doubled for fp32; the output is the logits, seq x vocab.

    Sharded units (the sharded strategy's default rule): each block of the layer list is one, holding
    (parameters - embeddings) / layers; the token embedding (vocab x width) is one when the output layer
    has its own weights (`tied=False`, LLaMA), and so is the output layer; a tied embedding stays with the
    root. The largest unit is the larger of a block and the embedding."""
    embedding = vocab * width
    block = (parameters - embedding * (1 if tied else 2)) / layers
    largest_unit = int(max(block, embedding))
    units = layers + (1 if tied else 3)  # the blocks, the root, and untied: the embedding and the output layer
    # a block's matrices as GPT-2 has them (the attention's input and output projections, the MLP's two), the MLP's
    # width set so that they hold the block's parameters (4 x width for GPT-2; LLaMA's three gated matrices hold
    # about as many); the embedding, and untied the output layer too
    mlp = max(1, round((block - 4 * width * width) / (2 * width)))
    matrices = (
        (width, 3 * width, layers),
        (width, width, layers),
        (width, mlp, layers),
        (mlp, width, layers),
        (vocab, width, 1 if tied else 2),
    )

    def build(input_shape: Sequence[int] | None = None, seq_len: int | None = None) -> ModelProfile:
        seq = int(seq_len or (input_shape[0] if input_shape else default_seq))
        if seq < 1:
            raise ValueError(f"seq_len: expected a positive sequence length for {name}, got {seq}")
        non_embedding = 12 * layers * width * width
        flops = (
            seq * (2 * non_embedding + 2 * layers * seq * width) + 2 * seq * width * vocab
        )  # + the output projection
        activations = 2 * layers * seq * width * (34 + 5 * heads * seq / width)
        kernels = 22 * layers + 12
        return ModelProfile(
            name,
            int(parameters),
            float(flops),
            kernels,
            float(activations),
            float(seq * vocab * FP32_BYTES),
            seq * 8.0,
            4 + 12 * layers,
            source + f"; seq_len {seq}",
            largest_unit,
            units,
            MODULES_PER_BLOCK * layers + 8,
            matrices,
        )

    return build


BUILTIN_PROFILES: dict[str, Callable[..., ModelProfile]] = {
    "resnet50": _cnn(
        "resnet50",
        25.557e6,
        4.09e9,
        175,
        103e6,
        161,
        "He et al. 2016 (arXiv:1512.03385) and torchvision's model card: 25.6M parameters, 4.09 GMACs at 224x224; "
        "activations ~103 MB/sample fp32 (an estimate from the feature-map sizes)",
        largest_unit=2_359_296,  # a layer4 3x3 convolution, 512x512x3x3; 17 units and the root
        units=18,
        modules=151,  # 53 convolutions, 53 batch norms, 17 ReLUs, 16 bottlenecks, 8 containers, pools, fc, root
    ),
    "resnet101": _cnn(
        "resnet101",
        44.549e6,
        7.80e9,
        345,
        155e6,
        314,
        "He et al. 2016 and torchvision's model card: 44.5M parameters, 7.80 GMACs at 224x224; "
        "activations ~155 MB/sample fp32 (estimated the same way)",
        largest_unit=2_359_296,
        units=35,
        modules=287,  # 104 convolutions, 104 batch norms, 34 ReLUs, 33 bottlenecks, 8 containers, pools, fc, root
    ),
    "bert-base": _transformer(
        "bert-base",
        110e6,
        12,
        768,
        30522,
        128,
        12,
        "Devlin et al. 2019 (arXiv:1810.04805): 110M parameters, 12 layers, width 768, 12 heads, vocab 30522",
    ),
    "bert-large": _transformer(
        "bert-large",
        340e6,
        24,
        1024,
        30522,
        128,
        16,
        "Devlin et al. 2019: 340M parameters, 24 layers, width 1024, 16 heads",
    ),
    "gpt2-124m": _transformer(
        "gpt2-124m",
        124e6,
        12,
        768,
        50257,
        1024,
        12,
        "Radford et al. 2019 (GPT-2 report) / Hugging Face gpt2: 124M parameters, 12 layers, width 768, context 1024",
    ),
    "gpt2-1.5b": _transformer(
        "gpt2-1.5b",
        1.558e9,
        48,
        1600,
        50257,
        1024,
        25,
        "Radford et al. 2019: 1.5B parameters, 48 layers, width 1600, context 1024",
    ),
    "llama-7b": _transformer(
        "llama-7b",
        6.738e9,
        32,
        4096,
        32000,
        2048,
        32,
        "Touvron et al. 2023 (arXiv:2302.13971): 6.7B parameters, 32 layers, width 4096, 32 heads, context 2048; "
        "untied output layer",
        tied=False,
    ),
}


def builtin_profile(name: str, input_shape: Sequence[int] | None = None, seq_len: int | None = None) -> ModelProfile:
    if name not in BUILTIN_PROFILES:
        raise ValueError(
            f"model: unknown built-in model {name!r}; choose one of {', '.join(BUILTIN_PROFILES)} "
            "or give a factory as 'package.module:factory'"
        )
    return BUILTIN_PROFILES[name](input_shape, seq_len)


def given_profile(
    parameters: float,
    flops_per_sample: float | None = None,
    *,
    name: str = "given",
    kernels_per_forward: int = 200,
    activation_bytes_per_sample: float | None = None,
    output_bytes_per_sample: float = 4000.0,
    input_bytes_per_sample: float = 3 * 224 * 224 * 4.0,
    largest_unit_parameters: float | None = None,
) -> ModelProfile:
    """A profile from numbers; what is not given is estimated from the parameter count (a transformer-like
    6N training FLOPs per token at 512 tokens per sample, and 16 activation bytes per parameter). Without
    `largest_unit_parameters` a sharded strategy is planned as gathering the whole model at once."""
    if parameters is None or parameters <= 0:
        raise ValueError(f"params: expected a positive parameter count, got {parameters!r}")
    if largest_unit_parameters is not None and not 0 < largest_unit_parameters <= parameters:
        raise ValueError(
            f"largest_unit_params: expected a positive count no larger than the model's {parameters:.4g} "
            f"parameters, got {largest_unit_parameters!r}"
        )
    flops = flops_per_sample if flops_per_sample is not None else 2.0 * parameters * 512
    activations = activation_bytes_per_sample if activation_bytes_per_sample is not None else 16.0 * parameters / 8
    return ModelProfile(
        name,
        int(parameters),
        float(flops),
        int(kernels_per_forward),
        float(activations),
        float(output_bytes_per_sample),
        float(input_bytes_per_sample),
        0,
        "given on the command line",
        int(largest_unit_parameters or 0),
    )


def with_name(profile: ModelProfile, name: str) -> ModelProfile:
    return replace(profile, name=name)
