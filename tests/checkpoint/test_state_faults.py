"""Nothing lost: a training state is loaded whole or not at all, a damaged state is never taken for no state,
stray entries are never taken for states, a failed save leaves the previous state, and the messages say what
happened (a full disk, an object weights-only loading refuses) in one line."""

from __future__ import annotations

import argparse
import errno
import logging
import os
from pathlib import Path

import pytest
import torch
from test_state import train_steps
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpkit
from dpkit.checkpoint import checked_files, steps, writes
from dpkit.checkpoint.model_files import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointRefusedError,
    CheckpointWriteError,
    atomic_save,
    read_checked,
)
from dpkit.cli.main import main as dpkit_main


def make_engine(optimizer="adam", *, seed=0):
    engine = dpkit.Engine(strategy="single", accelerator="cpu", devices=1, progress=False)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.Dropout(0.2), nn.Linear(5, 2))
    if optimizer == "adam":
        built = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        built = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, built = engine.setup(model, built)
    x = torch.randn(20, 3, generator=torch.Generator().manual_seed(1))
    loader = engine.setup_dataloader(
        DataLoader(TensorDataset(x, x.sum(1, keepdim=True).repeat(1, 2)), batch_size=4, shuffle=True)
    )
    return engine, model, built, loader


def trained(optimizer="adam", steps=3):
    """An engine after `steps` steps (and one more optimizer step, so that its state is not fresh)."""
    parts = make_engine(optimizer, seed=7)
    train_steps(*parts, steps)
    return parts


def snapshot(engine, model, optimizer, *objects):
    return {
        "weights": {k: v.clone() for k, v in dpkit.unwrap_model(model).state_dict().items()},
        "optimizer": repr(optimizer.state_dict()),
        "step": engine.step,
        "objects": [repr(o.state_dict()) for o in objects],
        "rng": torch.get_rng_state().clone(),
    }


def assert_unchanged(before, engine, model, optimizer, *objects):
    after = snapshot(engine, model, optimizer, *objects)
    assert all(torch.equal(before["weights"][k], after["weights"][k]) for k in before["weights"])
    assert before["optimizer"] == after["optimizer"] and before["step"] == after["step"]
    assert before["objects"] == after["objects"] and torch.equal(before["rng"], after["rng"])


# --- 1. load_state is all or nothing ------------------------------------------------------------------------


def test_an_optimizer_of_another_class_is_refused_before_anything_changes(tmp_path):
    engine, model, optimizer, loader = make_engine("adam")
    train_steps(engine, model, optimizer, loader, 3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=2)
    engine.save_state(tmp_path, scheduler=scheduler)
    other, other_model, sgd, other_loader = trained("sgd", steps=2)
    other_scheduler = torch.optim.lr_scheduler.StepLR(sgd.optimizer, step_size=2)
    before = snapshot(other, other_model, sgd, other_scheduler)
    with pytest.raises(
        CheckpointMismatchError, match="optimizer 0: the state was saved from Adam, this engine set up SGD"
    ):
        other.load_state(tmp_path, scheduler=other_scheduler)
    assert_unchanged(before, other, other_model, sgd, other_scheduler)


def test_optimizer_state_that_does_not_fit_the_parameters_is_refused(tmp_path):
    engine, model, optimizer, loader = trained("adam")
    engine.save_state(tmp_path)
    # a state saved before optimizers had their class recorded, with moments of another shape
    step = tmp_path / "step-00000003"
    shared = read_checked(step / "state.pt")
    shared.pop("optimizer_classes")
    shared["optimizers"][0]["state"][0]["exp_avg"] = torch.zeros(3, 5)
    atomic_save(shared, step / "state.pt")
    other, other_model, other_optimizer, _ = trained("adam", steps=1)
    before = snapshot(other, other_model, other_optimizer)
    with pytest.raises(CheckpointMismatchError, match=r"parameter 0's exp_avg: state \(3, 5\) vs parameter \(5, 3\)"):
        other.load_state(tmp_path)
    assert_unchanged(before, other, other_model, other_optimizer)


def test_a_scheduler_of_another_kind_is_refused_before_anything_changes(tmp_path):
    engine, model, optimizer, loader = trained("sgd")
    engine.save_state(tmp_path, scheduler=torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=2))
    other, other_model, other_optimizer, _ = trained("sgd", steps=1)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(other_optimizer.optimizer, T_max=10)
    before = snapshot(other, other_model, other_optimizer, cosine)
    with pytest.raises(
        CheckpointMismatchError, match="scheduler: the state was saved from StepLR, given CosineAnnealingLR"
    ):
        other.load_state(tmp_path, scheduler=cosine)
    assert_unchanged(before, other, other_model, other_optimizer, cosine)
    with pytest.raises(CheckpointMismatchError, match="warmup: not in the saved state's extras"):
        other.load_state(tmp_path, warmup=cosine)
    assert_unchanged(before, other, other_model, other_optimizer, cosine)


class Tally:
    """A named object whose load_state_dict changes it, then refuses the rest of the saved state."""

    def __init__(self, refuse: bool = False):
        self.count, self.best, self.refuse = 0, 0.0, refuse

    def state_dict(self) -> dict:
        return {"count": self.count, "best": self.best}

    def load_state_dict(self, saved: dict) -> None:
        self.count = saved["count"]
        if self.refuse:
            raise ValueError("best: expected a float in a newer layout")
        self.best = saved["best"]


def test_a_named_object_whose_load_state_dict_raises_is_undone_with_everything_before_it(tmp_path, monkeypatch):
    engine, model, optimizer, loader = trained("sgd")
    tally = Tally()
    tally.count, tally.best = 5, 0.25
    engine.save_state(
        tmp_path, scheduler=torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1), tally=tally
    )
    other, other_model, other_optimizer, _ = trained("sgd", steps=1)
    scheduler = torch.optim.lr_scheduler.StepLR(other_optimizer.optimizer, step_size=1)
    refusing = Tally(refuse=True)
    before = snapshot(other, other_model, other_optimizer, scheduler, refusing)
    with pytest.raises(
        CheckpointMismatchError, match=r"tally: loading its saved state from .* failed \(ValueError: best"
    ):
        other.load_state(tmp_path, scheduler=scheduler, tally=refusing)
    assert_unchanged(before, other, other_model, other_optimizer, scheduler, refusing)  # the scheduler put back too

    # a failure in the last step (the model) puts the optimizer and the objects back as well
    def failing_model_load(model, state):
        raise RuntimeError("device lost")

    monkeypatch.setattr(other.strategy, "load_model_state", failing_model_load)
    with pytest.raises(CheckpointMismatchError, match="the model: loading its saved state"):
        other.load_state(tmp_path, scheduler=scheduler, tally=Tally())
    assert_unchanged(before, other, other_model, other_optimizer, scheduler, refusing)


def test_a_named_model_that_does_not_match_is_refused_before_anything_changes(tmp_path):
    engine, model, optimizer, loader = trained("sgd")
    engine.save_state(tmp_path, teacher=nn.Linear(4, 2))
    other, other_model, other_optimizer, _ = trained("sgd", steps=1)
    teacher = nn.Linear(5, 2)
    before = snapshot(other, other_model, other_optimizer, teacher)
    shapes = r"(?s)teacher \(saved in .*weight: checkpoint \(2, 4\) vs model \(2, 5\)"
    with pytest.raises(CheckpointMismatchError, match=shapes):
        other.load_state(tmp_path, teacher=teacher)
    assert_unchanged(before, other, other_model, other_optimizer, teacher)


# --- 2. a damaged state is not "no state" -------------------------------------------------------------------


def saved_states(tmp_path, steps=(2, 4), keep=3):
    engine, model, optimizer, loader = make_engine()
    for step in steps:
        train_steps(engine, model, optimizer, loader, step)
        engine.save_state(tmp_path, keep=keep, note=step)
    return tmp_path


def resume(directory, **objects):
    """The documented resume recipe: FileNotFoundError means that nothing was saved yet."""
    engine = make_engine()[0]
    try:
        return engine.load_state(directory, **objects)
    except FileNotFoundError:
        return "afresh"


@pytest.mark.parametrize("removed", ["rank-0.pt", "state.pt"])
def test_a_state_missing_a_file_is_corrupt_not_absent(tmp_path, removed):
    saved_states(tmp_path)
    (tmp_path / "step-00000004" / removed).unlink()
    with pytest.raises(CheckpointCorruptError, match=f"step-00000004.*{removed}.*missing"):
        resume(tmp_path)
    with pytest.raises(CheckpointCorruptError, match=f"{removed}.*missing"):
        resume(tmp_path / "step-00000004")  # the step directory given directly
    (tmp_path / "latest").unlink()  # without the pointer: the newest step directory, still damaged
    with pytest.raises(CheckpointCorruptError, match="missing"):
        resume(tmp_path)
    assert resume(tmp_path / "step-00000002") == {"note": 2}  # the earlier state, asked for by name
    assert resume(tmp_path / "nothing-here") == "afresh" and resume(tmp_path / "step-00000004" / "x") == "afresh"


def test_a_state_holding_a_file_its_save_did_not_write_is_corrupt(tmp_path, caplog):
    saved_states(tmp_path)
    (tmp_path / "step-00000004" / "rank-1.pt").write_bytes((tmp_path / "step-00000004" / "rank-0.pt").read_bytes())
    with pytest.raises(
        CheckpointCorruptError, match=r"step-00000004: holds rank-1.pt, which this state's save did not"
    ):
        resume(tmp_path)
    (tmp_path / "step-00000004" / "rank-1.pt").unlink()
    (tmp_path / "step-00000004" / ".DS_Store").write_bytes(b"finder")  # the operating system's: ignored
    assert resume(tmp_path) == {"note": 4}


def test_keep_never_removes_good_states_after_a_resume_from_an_earlier_one(tmp_path):
    saved_states(tmp_path, steps=(2, 4, 6))
    (tmp_path / "step-00000006" / "rank-0.pt").unlink()  # the newest state is damaged
    engine, model, optimizer, loader = make_engine()
    engine.load_state(tmp_path / "step-00000004")  # the user resumes from the one before
    train_steps(engine, model, optimizer, loader, 5)
    engine.save_state(tmp_path, keep=2)
    # step 4 and 5 kept (2 complete states up to the new one), step 6 newer than the run: left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000004", "step-00000005", "step-00000006"]
    assert make_engine()[0].load_state(tmp_path) == {} and steps.read_latest(tmp_path).name == "step-00000005"


def test_keep_larger_than_the_states_saved_removes_nothing(tmp_path):
    saved_states(tmp_path, steps=(1, 2, 3), keep=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001", "step-00000002", "step-00000003"]


def sharded_save(tmp_path, monkeypatch):
    """A state whose model is in shards/ (as fsdp writes it), saved in this process through DCP."""
    engine, model, optimizer, loader = trained("adam")
    monkeypatch.setattr(
        engine.strategy, "sharded_state", lambda bare, optimizers: {"model": bare.state_dict(), "optimizers": {}}
    )
    with pytest.warns(UserWarning, match="single process"):
        return engine.save_state(tmp_path) / "shards"


def test_a_sharded_state_missing_or_holding_another_file_is_corrupt(tmp_path, monkeypatch):
    shards = sharded_save(tmp_path, monkeypatch)
    assert resume(tmp_path) == {}
    (shards / "stray.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointCorruptError, match=r"shards: holds stray.distcp, which this state did not write"):
        resume(tmp_path)
    (shards / "stray.distcp").unlink()
    shard = next(shards.glob("*.distcp"))
    shard.rename(tmp_path / "aside.distcp")
    with pytest.raises(CheckpointCorruptError, match=f"{shard.name}: a shard file of this state is missing"):
        resume(tmp_path)
    (tmp_path / "aside.distcp").rename(shard)
    (shards / ".metadata").rename(tmp_path / "metadata")
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata: a shard file of this state is missing"):
        resume(tmp_path)
    (tmp_path / "metadata").rename(shards / ".metadata")
    shards.rename(tmp_path / "shards-aside")
    with pytest.raises(CheckpointCorruptError, match="shards/?.* missing"):
        resume(tmp_path)
    from dpkit.cli.ckpt import inspect

    with pytest.raises(CheckpointCorruptError, match="missing"):  # dpkit ckpt inspect says so too
        inspect(tmp_path)


# --- 3. stray entries, and a pointer to a state that is gone --------------------------------------------------


def test_stray_step_entries_are_ignored_with_a_warning_and_never_cost_a_good_state(tmp_path, caplog):
    engine, model, optimizer, loader = make_engine()
    for step in (1, 2):
        train_steps(engine, model, optimizer, loader, step)
        engine.save_state(tmp_path, keep=2, note=step)
    copy = tmp_path / "step-00000002.bak"  # a person's backup copy
    copy.mkdir()
    for path in (tmp_path / "step-00000002").iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    (tmp_path / "step-00000009").mkdir()  # an empty folder
    (tmp_path / "step-00000007").write_text("notes")  # a file
    with caplog.at_level(logging.WARNING, logger="dpkit"):
        train_steps(engine, model, optimizer, loader, 3)
        engine.save_state(tmp_path, keep=2, note=3)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step-00000002", "step-00000002.bak", "step-00000003", "step-00000007", "step-00000009"]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(f"{name}: " in warned for name in ("step-00000002.bak", "step-00000007", "step-00000009"))
    assert "not a saved state; ignoring it" in warned
    (tmp_path / "latest").unlink()  # without the pointer, the newest real state, not the empty step-00000009
    assert resume(tmp_path) == {"note": 3}
    assert [p.name for p in steps.step_directories(tmp_path)] == ["step-00000002", "step-00000003"]


@pytest.mark.parametrize("how", ["gone", "empty"])
def test_latest_naming_a_state_that_is_gone_is_an_error_naming_it_and_the_way_back(tmp_path, how):
    saved_states(tmp_path)
    newest = tmp_path / "step-00000004"
    for path in newest.iterdir():
        path.unlink()
    if how == "gone":
        newest.rmdir()
    with pytest.raises(CheckpointCorruptError, match=f"latest names step-00000004, which is {how}") as info:
        resume(tmp_path)
    assert f"pass {tmp_path / 'step-00000002'} or delete {tmp_path / 'latest'}" in str(info.value)
    (tmp_path / "latest").unlink()
    assert resume(tmp_path) == {"note": 2}


# --- 4. messages: a refused object, a full disk --------------------------------------------------------------


class Crafted:
    def __reduce__(self):
        return (os.getcwd, ())


def test_an_object_weights_only_loading_refuses_is_named_not_called_damage(tmp_path):
    atomic_save({"args": argparse.Namespace(lr=0.1)}, tmp_path / "namespace.pt")
    with pytest.raises(CheckpointRefusedError) as info:
        read_checked(tmp_path / "namespace.pt")
    message = str(info.value)
    assert "holds a Python object (argparse.Namespace) that weights-only loading refuses" in message
    assert (
        "the file is not damaged" in message and "torch.serialization.add_safe_globals([argparse.Namespace])" in message
    )
    assert "full disk" not in message and "\n" not in message
    with torch.serialization.safe_globals([argparse.Namespace]):  # the way the message gives, for a trusted file
        assert read_checked(tmp_path / "namespace.pt")["args"].lr == 0.1

    torch.save({"x": Crafted()}, tmp_path / "crafted.pt")  # a module torch never allows (os)
    with pytest.raises(CheckpointRefusedError) as info:
        read_checked(tmp_path / "crafted.pt")
    message = str(info.value)
    assert "getcwd) that weights-only loading never allows" in message and "full disk" not in message
    assert isinstance(info.value, CheckpointCorruptError)  # still caught where a file that cannot load is


def failing_writes(monkeypatch, after_bytes=0):
    """torch.save's writes fail with a full disk once `after_bytes` went through."""
    written = {"bytes": 0}
    original = checked_files._HashingWriter.write

    def write(self, data):
        if written["bytes"] + len(data) > after_bytes:
            raise OSError(errno.ENOSPC, "No space left on device")
        written["bytes"] += len(data)
        return original(self, data)

    monkeypatch.setattr(checked_files._HashingWriter, "write", write)


@pytest.mark.parametrize("after_bytes", [0, 300])
def test_a_full_disk_during_a_save_is_one_line_and_the_previous_state_stays(tmp_path, monkeypatch, after_bytes):
    engine, model, optimizer, loader = trained("adam", steps=2)
    engine.save_state(tmp_path, note="first")
    train_steps(engine, model, optimizer, loader, 4)
    failing_writes(monkeypatch, after_bytes)
    with pytest.raises(CheckpointWriteError) as info:
        engine.save_state(tmp_path, note="second")
    message = str(info.value)
    written = tmp_path / "step-00000004" / "rank-0.pt"
    assert message == f"no space left on device while writing {written}; the previous state is intact"
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002"]  # no temporary left
    monkeypatch.undo()
    assert resume(tmp_path) == {"note": "first"}


def test_a_full_disk_while_pointing_latest_takes_the_new_state_back_out(tmp_path, monkeypatch):
    engine, model, optimizer, loader = trained("adam", steps=2)
    engine.save_state(tmp_path, note="first")
    pointer = (tmp_path / "latest").read_bytes()

    def full(path, write):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writes, "atomic_write", full)
    with pytest.raises(CheckpointWriteError, match=f"no space left on device while writing {tmp_path / 'latest'}"):
        engine.save_state(tmp_path, note="same step")  # the same step again: the old copy goes back in place
    train_steps(engine, model, optimizer, loader, 3)
    with pytest.raises(CheckpointWriteError, match="the previous state is intact"):
        engine.save_state(tmp_path, note="next step")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002"]
    assert (tmp_path / "latest").read_bytes() == pointer
    monkeypatch.undo()
    assert resume(tmp_path) == {"note": "first"}


@pytest.mark.parametrize("where", ["state", "shards"])
def test_any_failure_midway_through_a_save_leaves_nothing_behind(tmp_path, monkeypatch, where):
    saved_states(tmp_path, steps=(3,))
    before = sorted(p.name for p in tmp_path.iterdir())
    pointer = (tmp_path / "latest").read_bytes()
    engine, model, optimizer, loader = make_engine()
    train_steps(engine, model, optimizer, loader, 5)
    if where == "shards":
        monkeypatch.setattr(
            engine.strategy, "sharded_state", lambda bare, optimizers: {"model": bare.state_dict(), "optimizers": {}}
        )

        def broken(content, folder, group=None):
            folder.mkdir()
            (folder / "__0_0.distcp").write_bytes(b"half")
            raise RuntimeError("a shard write failed")

        monkeypatch.setattr(writes, "write_shards", broken)
    else:
        original = checked_files.write_checked

        def broken(content, handle):
            if "format" in content:  # state.pt, after rank-0.pt
                raise KeyError("a value torch cannot save")
            original(content, handle)

        monkeypatch.setattr(writes, "write_checked", broken)
    with pytest.raises((RuntimeError, KeyError), match="a shard write failed|a value torch cannot save"):
        engine.save_state(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before and (tmp_path / "latest").read_bytes() == pointer


def full_disk_job(out: str) -> str:
    """In each process of a group: a ddp state saved, then a second save during which rank 1's disk fills."""
    import errno

    import dpkit

    folder = Path(out)
    engine = dpkit.Engine(strategy="ddp", accelerator="cpu", devices=2, progress=False)
    model = nn.Linear(3, 2)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer.zero_grad()
    engine.backward(model(torch.ones(4, 3)).sum())
    optimizer.step()
    engine.save_state(folder / "state")
    write = checked_files._HashingWriter.write
    if engine.rank == 1:

        def full(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        checked_files._HashingWriter.write = full
    try:
        engine.save_state(folder / "state", note="second")
        result = "saved"
    except Exception as error:
        result = f"{type(error).__name__} {error}"
    finally:
        checked_files._HashingWriter.write = write  # the group's process runs other tests' jobs next
    engine.close()
    return result


def test_a_full_disk_in_one_process_raises_in_every_process_and_keeps_the_state(tmp_path, groups):
    """Two processes of a launched group: rank 1's disk fills during the second save; both raise (none waits
    for the other at a barrier), and the first state and `latest` are untouched."""
    results = groups(2).run(full_disk_job, str(tmp_path))
    assert results[1].startswith("CheckpointWriteError no space left on device while writing")
    assert results[0].startswith("CheckpointWriteError process 1 could not write its part of the state")
    assert all(result.count("the previous state is intact") == 1 for result in results)
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["latest", "step-00000001"]
    assert steps.read_latest(tmp_path / "state").name == "step-00000001"


def test_the_cli_says_a_full_disk_in_one_line(tmp_path, monkeypatch, capsys):
    torch.save(nn.Linear(2, 2).state_dict(), tmp_path / "in.pt")
    failing_writes(monkeypatch)
    assert dpkit_main(["ckpt", "convert", str(tmp_path / "in.pt"), str(tmp_path / "out.pt")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [
        f"dpkit ckpt: error: no space left on device while writing {tmp_path / 'out.pt'}; nothing was written"
    ]
    assert sorted(os.listdir(tmp_path)) == ["in.pt"]


# --- 5. dpkit ckpt: convert never replaces a file silently; inspect says when a format is unknown -------------


def test_ckpt_convert_refuses_to_replace_a_file_unless_told(tmp_path, capsys):
    torch.save({f"module.{k}": v for k, v in nn.Linear(2, 2).state_dict().items()}, tmp_path / "ddp.pt")
    (tmp_path / "out.pt").write_bytes(b"precious")
    assert dpkit_main(["ckpt", "convert", str(tmp_path / "ddp.pt"), str(tmp_path / "out.pt")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [
        f"dpkit ckpt: error: OUT: {tmp_path / 'out.pt'} exists; give --overwrite to replace it, or another file name"
    ]
    assert (tmp_path / "out.pt").read_bytes() == b"precious"
    assert dpkit_main(["ckpt", "convert", str(tmp_path / "ddp.pt"), str(tmp_path / "out.pt"), "--overwrite"]) == 0
    assert sorted(torch.load(tmp_path / "out.pt", weights_only=True)) == ["bias", "weight"]


def test_ckpt_inspect_warns_about_a_format_this_dpkit_does_not_write(tmp_path, capsys):
    saved_states(tmp_path / "state", steps=(2,))
    step = tmp_path / "state" / "step-00000002"
    shared = read_checked(step / "state.pt")
    shared["format"] = "dpkit-state/2"
    atomic_save(shared, step / "state.pt")
    assert dpkit_main(["ckpt", "inspect", str(tmp_path / "state")]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        f"dpkit ckpt inspect: warning: {step / 'state.pt'}: format 'dpkit-state/2', not the 'dpkit-state/1' this "
        "dpkit writes and reads; what follows may be incomplete, and engine.load_state refuses it"
    ]
    assert "training state: step 2" in captured.out
    with pytest.raises(CheckpointCorruptError, match="format 'dpkit-state/2', which this dpkit does not read"):
        resume(tmp_path / "state")

    atomic_save({"format": "trainer/7", "state_dict": nn.Linear(2, 2).state_dict()}, tmp_path / "other.pt")
    assert dpkit_main(["ckpt", "inspect", str(tmp_path / "other.pt")]) == 0
    captured = capsys.readouterr()
    assert (
        len(captured.err.strip().splitlines()) == 1 and "format 'trainer/7' is not one this dpkit knows" in captured.err
    )
    assert "weight" in captured.out
    assert dpkit_main(["ckpt", "inspect", str(step.parent)]) == 0 and "warning" in capsys.readouterr().err
    saved_states(tmp_path / "fine", steps=(1,))
    assert dpkit_main(["ckpt", "inspect", str(tmp_path / "fine")]) == 0 and capsys.readouterr().err == ""
