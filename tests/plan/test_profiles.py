"""Model profiles: measured on the meta device, built in, or given."""

import pytest
import torch
from torch import nn

from dpkit.plan.profiles import BUILTIN_PROFILES, builtin_profile, given_profile, measure_model


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 5))


def test_measure_counts_flops_parameters_and_bytes_of_a_known_model():
    profile = measure_model(mlp, (20,))
    assert profile.parameters == 20 * 30 + 30 + 30 * 5 + 5
    assert profile.flops_per_sample == 2 * (20 * 30 + 30 * 5)  # FlopCounterMode counts matmuls: 2 per multiply-add
    assert profile.output_bytes_per_sample == 5 * 4
    assert profile.input_bytes_per_sample == 20 * 4
    assert profile.parameter_tensors == 4
    assert profile.kernels_per_forward >= 3  # two linears and a relu
    # saved for backward: the input, the hidden pre-activation or relu output; not the weights
    assert 20 * 4 <= profile.activation_bytes_per_sample <= (20 + 30 + 30) * 4


def test_measure_does_not_touch_a_given_models_weights():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    measure_model(model, (20,))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_builtin_profiles_scale_with_input_size():
    assert {"resnet50", "resnet101", "bert-base", "bert-large", "gpt2-124m", "gpt2-1.5b", "llama-7b"} <= set(
        BUILTIN_PROFILES
    )
    base, big = builtin_profile("resnet50"), builtin_profile("resnet50", input_shape=(3, 448, 448))
    assert big.flops_per_sample == pytest.approx(4 * base.flops_per_sample)
    short, long = builtin_profile("gpt2-124m", seq_len=512), builtin_profile("gpt2-124m", seq_len=1024)
    assert 2 * short.flops_per_sample < long.flops_per_sample < 2.3 * short.flops_per_sample  # attention grows faster
    assert long.output_bytes_per_sample == 1024 * 50257 * 4
    # Kaplan et al.: forward ~2N FLOPs per token for a large model
    llama = builtin_profile("llama-7b", seq_len=2048)
    assert 2 * llama.parameters * 2048 * 0.9 < llama.flops_per_sample < 2 * llama.parameters * 2048 * 1.4
    for name in BUILTIN_PROFILES:
        assert builtin_profile(name).source


def test_bad_model_names_and_shapes():
    with pytest.raises(ValueError, match="model: unknown built-in model 'resnet5'"):
        builtin_profile("resnet5")
    with pytest.raises(ValueError, match="input_shape: "):
        builtin_profile("resnet50", input_shape=(224, 224))
    with pytest.raises(ValueError, match="params: expected"):
        given_profile(0)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.attention = nn.Linear(width, 3 * width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(x + self.attention(x)[..., : x.shape[-1]])


class TinyLM(nn.Module):
    """Token embedding, a list of blocks, a norm and an output layer, tied to the embedding or not."""

    def __init__(self, vocab=1000, width=128, layers=3, tied=True):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.output = nn.Linear(width, vocab, bias=False)
        if tied:
            self.output.weight = self.embedding.weight

    def forward(self, tokens):
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x))


@pytest.mark.parametrize(
    "factory",
    [
        lambda: TinyLM(tied=True),
        lambda: TinyLM(vocab=10_000, tied=False),
        lambda: nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 512), nn.Linear(512, 10)),
        mlp,
    ],
    ids=["tied", "untied", "large-linears", "small-mlp"],
)
def test_shard_units_follow_the_sharded_strategys_rule(factory):
    from dpkit.plan.profiles import UNIT_MIN_PARAMETERS, shard_unit_sizes
    from dpkit.strategies.fsdp import DEFAULT_UNIT_PARAMETERS, shard_units

    assert UNIT_MIN_PARAMETERS == DEFAULT_UNIT_PARAMETERS
    with torch.device("meta"):
        model = factory()
    taken: set[int] = set()
    expected = []
    for unit in shard_units(model):
        own = [p for p in unit.parameters() if id(p) not in taken]
        taken.update(id(p) for p in own)
        expected.append(sum(p.numel() for p in own))
    root = sum(p.numel() for p in model.parameters() if id(p) not in taken)
    assert shard_unit_sizes(model) == expected + ([root] if root else [])
    assert sum(shard_unit_sizes(model)) == sum(p.numel() for p in model.parameters())


def test_a_measured_profile_knows_its_largest_unit():
    profile = measure_model(lambda: TinyLM(vocab=10_000, tied=False), (16,), input_dtype=torch.long)
    width = 128
    block = 3 * width * width + 3 * width + 8 * width * width + 5 * width
    assert profile.largest_unit_parameters == 10_000 * width  # the embedding, larger than a block
    assert profile.shard_units == 3 + 2 + 1  # the blocks, the embedding, the output layer, the root (the norm)
    assert block < profile.largest_unit_parameters
    small = measure_model(mlp, (20,))
    assert small.largest_unit_parameters == small.parameters and small.shard_units == 1  # the root alone


def test_builtin_transformers_estimate_their_units():
    llama = builtin_profile("llama-7b")
    # Touvron et al. 2023: a block is 4 x 4096^2 attention + 3 x 4096 x 11008 MLP (+ norms); embeddings 32000 x 4096
    assert llama.unit_parameters == pytest.approx(4 * 4096**2 + 3 * 4096 * 11008, rel=0.01)
    assert llama.units == 32 + 3
    gpt2 = builtin_profile("gpt2-124m")
    assert gpt2.unit_parameters == 50257 * 768  # the tied embedding stays with the root, larger than a block
    resnet = builtin_profile("resnet50")
    assert resnet.unit_parameters == 512 * 512 * 3 * 3
