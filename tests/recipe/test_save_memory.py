"""Issue 48: a background save takes one staged copy of the training state in host memory, and `dpkit train` refuses
in one line, before any step and before the folder changes, when this machine has less available than that; in
every process alike."""

from __future__ import annotations

import pytest
import torch
from recipe_runs import train_here
from torch import nn
from torch.utils._pytree import tree_leaves

from dpkit import Engine
from dpkit.cli.main import main as dpkit_main
from dpkit.engine.resume.save import stage_training_state
from dpkit.recipe import save_memory
from dpkit.recipe.config import TrainConfig
from dpkit.recipe.optimization import build_optimizer
from dpkit.recipe.recipe import run
from dpkit.recipe.run import Run
from dpkit.recipe.save_memory import StagedCopy, node_bytes, saves_in_background, staged_copy
from dpkit.strategies import strategy_class

CPU = ["--accelerator", "cpu", "--no-progress"]
# the digits MLP: 64*128+128 + 128*128+128 + 128*10+10 = 26,122 float32 parameters, 104.5 kB, no buffers (313.5 kB
# with AdamW's two moments)
TOO_LITTLE = 1_000  # bytes "available": less than any staged copy here


def _refusal(staged: str, parts: str, sync: str = "sync_checkpoints=True", every: str = "checkpoint_every") -> str:
    return (
        f"{every}: 2 saves in the background, staging a copy of the training state in host memory ({staged}: "
        f"{parts}), but 1.0 kB is available; pass {sync} to write each save in place, or free memory"
    )


@pytest.fixture
def little_memory(monkeypatch):
    """This machine has TOO_LITTLE bytes available (as save_memory reads it); training steps are counted."""
    monkeypatch.setattr(save_memory, "available_bytes", lambda: TOO_LITTLE)
    steps = []
    micro_batch = Run._micro_batch
    monkeypatch.setattr(Run, "_micro_batch", lambda run, x, y: steps.append(1) or micro_batch(run, x, y))
    return steps


@pytest.mark.parametrize("optimizer,momentum", [("adamw", 0.0), ("adam", 0.0), ("sgd", 0.9), ("sgd", 0.0)])
def test_the_estimate_is_the_bytes_of_a_real_staged_copy(optimizer, momentum, tmp_path):
    torch.manual_seed(0)
    # a buffer (BatchNorm's running statistics) and a frozen parameter: the state holds both, the optimizer neither
    bare = nn.Sequential(nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 10))
    bare[0].bias.requires_grad_(False)
    estimate = staged_copy(bare, optimizer, momentum)
    engine = Engine(strategy="single", accelerator="cpu", devices=1)
    model, opt = engine.setup(bare, build_optimizer(optimizer, bare.parameters(), 0.01, momentum, 0.0))
    opt.zero_grad()
    engine.backward(nn.functional.cross_entropy(model(torch.randn(8, 256)), torch.randint(0, 10, (8,))))
    opt.step()  # the optimizer's state exists once it has stepped
    staged = stage_training_state(engine._set_up("test"), tmp_path, keep=2, extra={}, copy=True)
    engine.close()
    real = sum(leaf.nbytes for leaf in tree_leaves([staged.shared, staged.mine]) if isinstance(leaf, torch.Tensor))
    assert estimate.total_bytes == pytest.approx(real, rel=0.01)  # the rest: generators, Adam's step counts
    moments = {"adamw": 2, "adam": 2, "sgd": 1 if momentum else 0}[optimizer]
    assert estimate.optimizer_bytes == moments * sum(p.nbytes for p in bare.parameters() if p.requires_grad)


def test_what_a_node_stages_follows_the_strategy_traits():
    copy = StagedCopy(model_bytes=400, optimizer_bytes=800, optimizer_state="AdamW's two moments")
    ddp, fsdp = strategy_class("ddp").traits, strategy_class("fsdp").traits
    zero1, hsdp = strategy_class("zero").traits_for(stage=1), strategy_class("hsdp").traits
    assert node_bytes(copy, ddp, processes=8, per_node=4) == 1200  # gathered to rank 0: all of it on its node
    assert node_bytes(copy, hsdp, processes=8, per_node=4) == 1200  # a shard group per node: one copy per node
    assert node_bytes(copy, fsdp, processes=8, per_node=4) == 600  # sharded over both nodes: half on each
    assert node_bytes(copy, zero1, processes=4, per_node=4) == 4 * 400 + 800  # each keeps the weights whole


def test_only_saves_before_the_last_step_are_in_the_background():
    config = TrainConfig(steps=10, checkpoint_every=4)
    assert saves_in_background(config, step=0) and saves_in_background(config, step=7)
    assert not saves_in_background(config, step=8)  # the save at 10 is the last one, written in place
    assert not saves_in_background(TrainConfig(steps=10, checkpoint_every=10), step=0)
    assert not saves_in_background(TrainConfig(steps=10, checkpoint_every=4, sync_checkpoints=True), step=0)
    assert not saves_in_background(TrainConfig(steps=10), step=0)


def test_a_save_that_will_not_fit_is_refused_before_any_step_and_before_the_old_run_goes(tmp_path, little_memory):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text("{}")  # an earlier run, which overwrite=True would remove
    (out / "model.pt").write_bytes(b"earlier")
    config = TrainConfig(
        accelerator="cpu", optimizer="adamw", steps=6, checkpoint_every=2, out=str(out), overwrite=True, progress=False
    )
    with pytest.raises(ValueError) as refused:
        run(config)
    assert str(refused.value) == _refusal("313.5 kB", "the weights and AdamW's two moments")
    assert little_memory == []
    assert sorted(path.name for path in out.iterdir()) == ["model.pt", "run.json"]
    assert (out / "model.pt").read_bytes() == b"earlier"


def test_the_command_says_it_in_its_flags(tmp_path, little_memory, capsys):
    argv = ["train", *CPU, "--steps", "6", "--checkpoint-every", "2", "--out", str(tmp_path / "run")]
    assert dpkit_main(argv) == 2
    err = capsys.readouterr().err.strip()
    said = _refusal("104.5 kB", "the weights", sync="--sync-checkpoints", every="--checkpoint-every")
    assert err == f"dpkit train: error: {said}"
    assert little_memory == [] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags", [["--checkpoint-every", "2", "--sync-checkpoints"], [], ["--checkpoint-every", "6"]])
def test_no_refusal_without_a_background_save(flags, tmp_path, little_memory):
    assert dpkit_main(["train", *CPU, "--steps", "6", *flags, "--out", str(tmp_path / "run")]) == 0
    assert len(little_memory) == 6


def train_with_little_memory(argv: list[str]) -> tuple[int, str]:
    """In each launched process: `dpkit train argv` on a machine with TOO_LITTLE bytes available."""
    available = save_memory.available_bytes
    save_memory.available_bytes = lambda: TOO_LITTLE
    try:
        return train_here(argv)
    finally:
        save_memory.available_bytes = available


def test_every_process_of_a_launched_run_refuses_and_rank_0_says_it_once(tmp_path, groups):
    out = tmp_path / "run"
    argv = ["--strategy", "ddp", "--devices", "2", *CPU, "--steps", "6", "--checkpoint-every", "2", "--out", str(out)]
    (code_0, said_0), (code_1, said_1) = groups(2).run(train_with_little_memory, argv)
    said = _refusal("104.5 kB", "the weights", sync="--sync-checkpoints", every="--checkpoint-every")
    assert (code_0, code_1) == (2, 2)
    assert f"dpkit train: error: {said}" in said_0.splitlines() and "error" not in said_1
    assert not (out / "state").exists() and not (out / "metrics.csv").exists()
