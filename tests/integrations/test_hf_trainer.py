"""Hugging Face Trainer through dpkit.integrations.hf_trainer.data_parallel on two virtual CPU devices: the
weights after training equal a single-device Trainer run's, for a tiny BERT classifier and a tiny GPT-2 LM
built from configs, with a last batch that splits unevenly and with num_items_in_batch."""

import copy
import pathlib
import re

import pytest
import torch

import dpkit
import dpkit.integrations.hf_trainer
from closeness import difference_to_scale

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

TOLERANCE = 1e-5  # relative to the values' size (tests/closeness.py): the replicas sum in other orders
ROWS, BATCH = 11, 4  # batches of 4, 4 and 3: the last one splits [2, 1] on two devices


def tiny_bert_classifier():
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def tiny_gpt2():
    config = transformers.GPT2Config(
        vocab_size=50,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def classification_rows():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (ROWS, 8), generator=generator)
    labels = torch.randint(0, 3, (ROWS,), generator=generator)
    return [
        {"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.long), "labels": labels[i]}
        for i in range(ROWS)
    ]


def language_model_rows():
    """Padded to 10 tokens with lengths 3..10, so the replicas hold different numbers of counted tokens."""
    generator = torch.Generator().manual_seed(2)
    rows = []
    for i in range(ROWS):
        length = 3 + (i * 5) % 8
        ids = torch.zeros(10, dtype=torch.long)
        ids[:length] = torch.randint(1, 50, (length,), generator=generator)
        mask = (torch.arange(10) < length).long()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return rows


def make_trainer(model, rows, tmp_path, optim, learning_rate):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        num_train_epochs=1,
        learning_rate=learning_rate,
        per_device_eval_batch_size=BATCH,
        optim=optim,
        seed=3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=rows)


class CountSpy:
    """Records what reaches the model's forward in each replica: rows and num_items_in_batch."""

    def __init__(self, model):
        self.calls = []
        self.handle = model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs):
        self.calls.append((kwargs["input_ids"].shape[0], kwargs.get("num_items_in_batch")))


def train_both(model, rows, tmp_path, optim="sgd", learning_rate=0.1):
    reference = copy.deepcopy(model)
    reference_trainer = make_trainer(reference, rows, tmp_path / "single", optim, learning_rate)
    reference_trainer.train()
    spy = CountSpy(model)
    trainer = make_trainer(model, rows, tmp_path / "dpkit", optim, learning_rate)
    dpkit.integrations.hf_trainer.data_parallel(trainer, dpkit.cpu_devices(2))
    trainer.train()
    trainer.reference_trainer = reference_trainer
    worst = difference_to_scale(list(model.parameters()), list(reference.parameters()))
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), tiny_copy_of(model, reference)))
    return worst, moved, spy, trainer


def tiny_copy_of(model, reference):
    """The initial weights (rebuilt with the same seed), to show that training moved them."""
    fresh = tiny_bert_classifier() if isinstance(model, transformers.BertForSequenceClassification) else tiny_gpt2()
    return list(fresh.parameters())


def test_bert_classifier_trains_to_the_single_device_weights(tmp_path):
    model = tiny_bert_classifier()
    worst, moved, spy, trainer = train_both(model, classification_rows(), tmp_path)
    assert moved > 1e-3  # training changed the weights, so equality below means something
    assert worst <= TOLERANCE, f"weights {worst:.3g} of their size from single's"
    # 2 rows per replica, and the last batch split 2 + 1
    assert sorted(rows for rows, _ in spy.calls).count(1) == 1
    assert isinstance(trainer.model_wrapped, dpkit.integrations.hf_trainer.TrainerDataParallel)
    rows = classification_rows()  # evaluation goes through the wrapper too: batches of 4, 4, 3
    got, expected = trainer.evaluate(rows)["eval_loss"], trainer.reference_trainer.evaluate(rows)["eval_loss"]
    assert got == pytest.approx(expected, rel=TOLERANCE)


def test_gpt2_language_model_with_num_items_in_batch_trains_to_the_single_device_weights(tmp_path):
    model = tiny_gpt2()
    worst, moved, spy, _ = train_both(model, language_model_rows(), tmp_path, optim="adamw_torch", learning_rate=1e-3)
    assert moved > 1e-3
    assert worst <= TOLERANCE, f"weights {worst:.3g} of their size from single's"
    counts = [count for _, count in spy.calls]
    assert all(isinstance(c, torch.Tensor) and c.dim() == 0 for c in counts), (
        "num_items_in_batch reaches each replica whole"
    )
    assert sorted(rows for rows, _ in spy.calls).count(1) == 1


@pytest.mark.parametrize("count_shape", [(), (2, 1)])  # Trainer's 0-dim count, and its nn.DataParallel form
def test_uneven_split_loss_is_the_batch_loss_where_a_mean_of_replica_means_is_not(count_shape):
    model = tiny_gpt2()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # confident predictions: per-token losses far apart
    batch = transformers.default_data_collator(language_model_rows()[:3])  # 9 + 4 counted tokens: split 2 + 1
    counted = (batch["labels"][:, 1:] != -100).sum()
    expected = model(**batch, num_items_in_batch=counted).loss
    wrapped = dpkit.integrations.hf_trainer.TrainerDataParallel(model, dpkit.cpu_devices(2))
    loss = wrapped(**batch, num_items_in_batch=counted.expand(count_shape) if count_shape else counted).loss
    assert loss.dim() == 0 and loss.item() == pytest.approx(expected.item(), rel=TOLERANCE)
    # without a count each replica's loss is the mean over its own tokens; weighted by tokens, still exact
    assert wrapped(**batch).loss.item() == pytest.approx(expected.item(), rel=TOLERANCE)
    means = [model(**{k: v[s] for k, v in batch.items()}).loss for s in (slice(0, 2), slice(2, 3))]
    mean_of_means = torch.stack(means).mean().item()  # what loss.mean() gives
    assert mean_of_means != pytest.approx(expected.item(), rel=100 * TOLERANCE)


def test_bad_trainer_argument_is_named():
    with pytest.raises(TypeError, match="trainer: expected a transformers.Trainer"):
        dpkit.integrations.hf_trainer.data_parallel(object(), dpkit.cpu_devices(2))


def test_the_documented_recipe_runs(tmp_path, monkeypatch):
    text = (pathlib.Path(__file__).parents[2] / "docs" / "hf-trainer.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2 and sum("dpkit" in line for line in blocks[0].splitlines()) == 2  # two lines added
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(blocks[1], "docs/hf-trainer.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert isinstance(trainer.model_wrapped, dpkit.integrations.hf_trainer.TrainerDataParallel)
    assert trainer.state.global_step == 3
