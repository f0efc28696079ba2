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
