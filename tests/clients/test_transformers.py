"""Tiny transformers models built from configs (nothing downloaded) through dpkit.DataParallel on two
virtual CPU devices, compared with a single-device run of the same weights."""

import copy

import pytest
import torch

import dpkit
from closeness import assert_close_to_scale

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

TOLERANCE = 1e-5  # relative to the values' size (tests/closeness.py): chunks and the whole batch round apart


def hook_count(model):
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_with_kwargs) for m in model.modules()
    )


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(model, reference):
    assert_close_to_scale(grads(model), grads(reference), TOLERANCE, "gradients")


def tiny_bert():
    config = transformers.BertConfig(
        vocab_size=60,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        attn_implementation="eager",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertModel(config)


def test_bert_with_hidden_states_and_attentions_matches_and_leaves_the_model_alone():
    model = tiny_bert()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 60, (5, 7))
    mask = torch.ones(5, 7, dtype=torch.long)
    mask[3, 5:] = 0
    hooks_before = hook_count(model)
    dp = dpkit.DataParallel(model, dpkit.cpu_devices(2))
    for _ in range(2):  # the second call must not see hooks the first one installed
        out = dp(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    expected = reference(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == len(expected.hidden_states) == 3
    assert len(out.attentions) == len(expected.attentions) == 2
    for got, want in zip(
        (out.last_hidden_state, *out.hidden_states, *out.attentions),
        (expected.last_hidden_state, *expected.hidden_states, *expected.attentions),
    ):
        assert_close_to_scale(got, want, TOLERANCE, "outputs")
    (out.last_hidden_state.pow(2).mean() + out.pooler_output.sum()).backward()
    (expected.last_hidden_state.pow(2).mean() + expected.pooler_output.sum()).backward()
    assert_same_grads(model, reference)
    # the user's bare model is unchanged: no hooks added, the same outputs
    assert hook_count(model) == hooks_before
    bare = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(bare.hidden_states) == 3
    assert_close_to_scale(bare.last_hidden_state, expected.last_hidden_state, TOLERANCE, "the bare model's output")


def tiny_gpt2():
    config = transformers.GPT2Config(
        vocab_size=50,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        bos_token_id=49,
        eos_token_id=49,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_with_labels_and_padding_matches_per_replica_and_in_gradients():
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 50, (5, 6))
    mask = torch.ones(5, 6, dtype=torch.long)
    mask[1, 4:] = 0
    mask[4, 2:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    dp = dpkit.DataParallel(model, dpkit.cpu_devices(2))
    with pytest.warns(UserWarning, match="0-dim"):  # one loss per replica, gathered as a vector (as in torch)
        out = dp(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.loss.shape == (2,)
    rows = dpkit.split_sizes(5, 2)
    for i, (start, n) in enumerate(((0, rows[0]), (rows[0], rows[1]))):
        chunk = slice(start, start + n)
        own = reference(input_ids=ids[chunk], attention_mask=mask[chunk], labels=labels[chunk]).loss
        assert_close_to_scale(out.loss[i], own, TOLERANCE, f"replica {i}'s loss")
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    assert_close_to_scale(out.logits, expected.logits, TOLERANCE, "logits")
    # a loss over the gathered logits is the single-device loss, and so are its gradients
    reference.zero_grad()
    loss_fn = torch.nn.CrossEntropyLoss()
    loss_fn(out.logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1)).backward()
    loss_fn(expected.logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1)).backward()
    assert_same_grads(model, reference)
