"""Models as users write them, through dpkit.DataParallel on two virtual CPU devices, compared with a
single-device run: an LSTM language model split on dim=1, a module that reads next(self.parameters()),
and a torch.compile'd model (refused, with the user's model untouched)."""

import copy

import pytest
import torch
from torch import nn

import dpkit
from closeness import assert_close_to_scale

TOLERANCE = 1e-5  # relative to the values' size (tests/closeness.py): chunks and the whole batch round apart


def assert_same_grads(model, reference):
    grads, expected = [p.grad for p in model.parameters()], [q.grad for q in reference.parameters()]
    assert_close_to_scale(grads, expected, TOLERANCE, "gradients")


class LSTMLanguageModel(nn.Module):
    """Sequence-first, as pytorch/examples' word language model: input (seq, batch)."""

    def __init__(self, vocab=40, hidden=12, flatten=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden)
        self.decoder = nn.Linear(hidden, vocab)
        self.flatten = flatten

    def forward(self, tokens):
        output, _ = self.lstm(self.embed(tokens))
        logits = self.decoder(output)
        return logits.view(-1, logits.size(-1)) if self.flatten else logits


def test_lstm_language_model_split_on_dim_1_matches():
    model = LSTMLanguageModel()
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 40, (6, 5))  # (seq, batch)
    out = dpkit.DataParallel(model, dpkit.cpu_devices(2), dim=1)(tokens)
    expected = reference(tokens)
    assert out.shape == expected.shape == (6, 5, 40)
    assert_close_to_scale(out, expected, TOLERANCE, "outputs")
    out.log_softmax(-1).mean().backward()
    expected.log_softmax(-1).mean().backward()
    assert_same_grads(model, reference)


def test_lstm_language_model_that_flattens_its_batch_is_warned_about():
    model = LSTMLanguageModel(flatten=True)
    tokens = torch.randint(0, 40, (6, 4))
    with pytest.warns(UserWarning, match="flattened into dim 0"):
        dpkit.parallel.data_parallel(model, tokens, ["cpu:0", "cpu:1"], dim=1)


class ReadsItsParameters(nn.Module):
    """Casts its input to its parameters' dtype and device, as transformers' .dtype / .device do."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        first = next(self.parameters())
        return self.body(x.to(dtype=first.dtype, device=first.device))


def test_module_reading_next_parameters_runs_in_every_replica():
    model = ReadsItsParameters().double()
    reference = copy.deepcopy(model)
    x = torch.randn(7, 4)  # float32 in, cast inside to the model's float64
    out = dpkit.DataParallel(model, dpkit.cpu_devices(3))(x)
    expected = reference(x)
    assert out.dtype == torch.float64
    assert_close_to_scale(out, expected, TOLERANCE, "outputs")
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    assert_same_grads(model, reference)


def test_torch_compiled_model_is_refused_and_the_users_model_is_unchanged():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(6, 4)
    with pytest.raises(TypeError, match="torch.compile'd.*uncompiled model"):
        dp = dpkit.DataParallel(compiled, dpkit.cpu_devices(2))
        dp(x)  # until the wrapper checks at construction, the first call refuses
    assert list(model._modules) == ["0", "1", "2"]
    assert torch.equal(model(x), reference(x))
    assert model.state_dict().keys() == reference.state_dict().keys()
    # what the message suggests runs: the uncompiled model in dpkit's wrapper
    out = dpkit.DataParallel(compiled._orig_mod, dpkit.cpu_devices(2))(x)
    assert_close_to_scale(out, reference(x), TOLERANCE, "outputs")
