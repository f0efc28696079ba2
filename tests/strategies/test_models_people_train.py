"""The models people train, under the single-process strategies, against one device (issue 32).

A model that computes its own loss (a tensor, a dict entry, a transformers-like `ModelOutput`, a tuple element),
gradient checkpointing (reentrant and not), parameters a step does not use, in float32 and bf16-mixed: three
SGD steps of `out = model(x, labels=y); engine.backward(loss_of(out)); optimizer.step()` under each strategy
must leave the weights of a single-device run (max difference 1e-5 in float32). The per-device strategies
(ddp, fsdp, zero, hsdp) are the matrix's other half (see the report of issue 32).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from model_matrix_runs import Output  # transformers' ModelOutput in miniature
from torch import nn
from torch.utils.checkpoint import checkpoint

import dpkit
import dpkit.observe  # noqa: F401  # plugs in the measured balance dp-balanced needs
from closeness import assert_close_to_scale, difference_to_scale

STRATEGIES = ["dp", "dp-balanced", "replicated"]
# relative to the largest weight (tests/closeness.py); bf16's rounding differs with the rows each matmul sees
TOLERANCE = {"32": 1e-5, "bf16-mixed": 2e-2}
STEPS = 3
SPARE_STEPS = [False]  # whether the step's forward uses TinyModel.spare (unused=True): odd steps only


class TinyModel(nn.Module):
    """A classifier that computes its own mean loss from `labels`, as transformers models do."""

    def __init__(self, returns="dict", checkpointing=None, unused=False, frozen=False):
        super().__init__()
        self.embed = nn.Linear(6, 16).requires_grad_(not frozen)  # frozen: never a gradient
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)
        self.spare = nn.Linear(16, 4)  # used on odd steps only when `unused`
        self.returns, self.checkpointing, self.unused = returns, checkpointing, unused
        self.calls = 0

    def forward(self, x, labels):
        h = torch.tanh(self.embed(x))
        if self.checkpointing is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.checkpointing == "reentrant")
        logits = self.head(h)
        if self.unused and SPARE_STEPS[0]:  # every replica (persistent copies too) takes the same branch
            logits = logits + self.spare(h)
        loss = F.cross_entropy(logits.float(), labels)
        if self.returns == "tensor":
            return loss
        if self.returns == "tuple":
            return loss, logits
        if self.returns == "output":
            return Output(loss=loss, logits=logits)
        return {"loss": loss, "logits": logits}


def loss_of(out, returns):
    if returns == "tensor":
        return out
    if returns == "tuple":
        return out[0]
    if returns == "output":
        return out.loss
    return out["loss"]


def batches():
    torch.manual_seed(1)
    return [(torch.randn(10, 6), torch.randint(0, 4, (10,))) for _ in range(STEPS)]


def train(strategy, precision, criterion=False, **model_kwargs):
    torch.manual_seed(0)
    model = TinyModel(**model_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    devices = 1 if strategy == "single" else 2
    engine = dpkit.Engine(strategy=strategy, accelerator="cpu", devices=devices, precision=precision)
    model, optimizer = engine.setup(model, optimizer)
    if criterion:  # set up for an evaluation, say: dp-balanced's and replicated's model(x) then defers its forward
        engine.setup_criterion(nn.CrossEntropyLoss())
    logits_seen = []
    for step, (x, y) in enumerate(batches()):
        SPARE_STEPS[0] = step % 2 == 1
        optimizer.zero_grad()
        out = model(x, labels=y)  # the Engine's model runs its forward under the precision's autocast
        loss = loss_of(out, model_kwargs.get("returns", "dict"))
        assert loss.dim() == 0
        if model_kwargs.get("returns") in ("dict", "output"):
            logits_seen.append(out["logits"].shape)
        engine.backward(loss)
        optimizer.step()
    bare = dpkit.unwrap_model(model)
    return {k: v.detach().float().clone() for k, v in bare.state_dict().items()}, logits_seen


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


CELLS = [
    ("returns", {"returns": "tensor"}),
    ("dict", {"returns": "dict"}),
    ("model-output", {"returns": "output"}),
    ("tuple", {"returns": "tuple"}),
    ("checkpoint", {"checkpointing": "non-reentrant"}),
    ("checkpoint-reentrant", {"checkpointing": "reentrant"}),
    ("unused", {"unused": True}),
    ("frozen", {"frozen": True}),
]


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("cell", [c for c, _ in CELLS])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cell_equals_single(strategy, cell, precision):
    kwargs = dict(CELLS)[cell]
    reference, logits_single = train("single", precision, **kwargs)
    weights, logits = train(strategy, precision, **kwargs)
    initial = TinyModel().state_dict()
    assert max_diff(reference, {k: v.float() for k, v in initial.items()}) > 1e-2  # the steps moved the weights
    diff = difference_to_scale(weights, reference)
    assert diff <= TOLERANCE[precision], f"{strategy} / {cell} / {precision}: {diff:.3g} of the weights' size off"
    assert logits == logits_single  # the whole batch's logits, gathered


@pytest.mark.parametrize("returns", ["dict", "output", "tuple"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_deferred_output_behaves_like_the_models(strategy, returns):
    """With a criterion set up, dp-balanced and replicated defer the forward; used as the model's output
    (subscript, attribute, tuple element) it runs it and equals one device."""
    reference, _ = train("single", "32", returns=returns)
    weights, _ = train(strategy, "32", criterion=True, returns=returns)
    assert difference_to_scale(weights, reference) <= TOLERANCE["32"]


def test_dp_data_parallel_keeps_torchs_vector_of_losses():
    """dpkit.DataParallel alone keeps torch's behaviour: one loss per replica, and torch's warning."""
    torch.manual_seed(0)
    model = TinyModel(returns="tensor")
    x, y = batches()[0]
    with pytest.warns(UserWarning, match="one value per replica"):
        losses = dpkit.DataParallel(model, dpkit.cpu_devices(2))(x, labels=y)
    assert losses.shape == (2,)


@pytest.mark.filterwarnings("ignore:output. replicas returned 0-dim tensors")
def test_checkpointed_replicas_match_fresh_replicas_twice():
    """Kept replicas hold a call's weights until the next call: a checkpoint's recompute finds them."""
    torch.manual_seed(0)
    for mode in ("non-reentrant", "reentrant"):
        model = TinyModel(returns="tensor", checkpointing=mode)
        ref = copy.deepcopy(model)
        dp = dpkit.DataParallel(model, dpkit.cpu_devices(2))
        for x, y in batches():
            model.zero_grad()
            ref.zero_grad()
            dp(x, labels=y).sum().backward()
            halves = [ref(x[:5], labels=y[:5]), ref(x[5:], labels=y[5:])]
            (halves[0] + halves[1]).backward()
            grads, expected = [p.grad for p in model.parameters()], [q.grad for q in ref.parameters()]
            assert_close_to_scale(grads, expected, what=f"gradients, {mode} checkpointing")
