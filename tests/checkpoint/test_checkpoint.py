import logging
import multiprocessing
import os
import random
import signal
import stat
import time

import pytest
import torch
from torch import nn

import dpkit
from dpkit.checkpoint.model_files import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    atomic_save,
    strip_prefixes,
    unwrap_model,
    verify_file,
)
from dpkit.cli.main import main as dpkit_main


def small_model():
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def wrappers():
    return {
        "bare": lambda m: m,
        "dpkit": lambda m: dpkit.DataParallel(m, dpkit.cpu_devices(2)),
        "torch-dp": lambda m: nn.DataParallel(m),
        "compiled": lambda m: torch.compile(m),
        "dp-compiled": lambda m: torch.compile(dpkit.DataParallel(m, dpkit.cpu_devices(2))),  # wrap first, then compile
    }


@pytest.mark.parametrize("wrap", list(wrappers()))
def test_save_model_writes_clean_keys_whatever_the_wrapper(tmp_path, wrap):
    model = small_model()
    wrapped = wrappers()[wrap](model)
    path = dpkit.save_model(wrapped, tmp_path / "model.pt")
    state = torch.load(path, weights_only=True)
    assert set(state) == set(model.state_dict())
    fresh = small_model()
    fresh.load_state_dict(state)  # strict, into the bare model
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)


def test_unwrap_model_reaches_the_bare_module():
    model = small_model()
    assert unwrap_model(torch.compile(dpkit.DataParallel(nn.DataParallel(model), dpkit.cpu_devices(1)))) is model


@pytest.mark.parametrize("wrap", list(wrappers()))
def test_load_model_accepts_prefixed_checkpoints_into_any_wrapper(tmp_path, wrap):
    source = small_model()
    prefixed = {f"module._orig_mod.{k}": v for k, v in source.state_dict().items()}
    torch.save(prefixed, tmp_path / "prefixed.pt")
    target = small_model()
    dpkit.load_model(wrappers()[wrap](target), tmp_path / "prefixed.pt")
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value)


def test_mismatch_lists_missing_and_unexpected_keys_and_changes_nothing(tmp_path):
    source = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5))
    state = source.state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["1.bias"]
    torch.save(state, tmp_path / "bad.pt")
    target = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as info:
        dpkit.load_model(target, tmp_path / "bad.pt")
    message = str(info.value)
    assert "missing keys (1): 1.bias" in message and "unexpected keys (1): extra.weight" in message
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_shape_mismatch_changes_nothing(tmp_path):
    torch.save(nn.Linear(3, 5).state_dict(), tmp_path / "wide.pt")
    target = nn.Linear(3, 4)
    before = target.weight.clone()
    with pytest.raises(CheckpointMismatchError, match=r"weight: checkpoint \(5, 3\) vs model \(4, 3\)"):
        dpkit.load_model(target, tmp_path / "wide.pt")
    assert torch.equal(before, target.weight)


class NotATensor:
    """A picklable object that weights_only=True must refuse to load."""


def test_load_uses_weights_only(tmp_path):
    torch.save({"weight": NotATensor()}, tmp_path / "pickle.pt")
    with pytest.raises(
        dpkit.CheckpointCorruptError, match=r"pickle\.pt: holds a Python object \(.*NotATensor\).*weights_only=True"
    ):
        dpkit.load_model(nn.Linear(1, 1), tmp_path / "pickle.pt")


def test_a_failed_save_leaves_the_old_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "model.pt"
    dpkit.save_model(nn.Linear(2, 2), path)
    good = path.read_bytes()

    def broken_save(obj, handle):
        handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        dpkit.save_model(nn.Linear(2, 2), path)
    assert path.read_bytes() == good
    assert os.listdir(tmp_path) == ["model.pt"]  # no temporary file left behind


def test_strip_prefixes_detects_collisions():
    with pytest.raises(CheckpointMismatchError, match="both map to 'w'"):
        strip_prefixes({"w": 1, "module.w": 2})


def test_save_errors_name_the_argument(tmp_path):
    with pytest.raises(TypeError, match="model"):
        dpkit.save_model("not a model", tmp_path / "m.pt")
    with pytest.raises(IsADirectoryError, match="path"):
        atomic_save({}, tmp_path)
    with pytest.raises(FileNotFoundError, match="path: no checkpoint"):
        dpkit.load_model(nn.Linear(1, 1), tmp_path / "missing.pt")


def test_engine_wrappers_save_and_load_like_any_other(tmp_path):
    for strategy in ("dp-balanced", "replicated"):
        engine = dpkit.Engine(strategy=strategy, accelerator="cpu", devices=2)
        source = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        model, _ = engine.setup(source, torch.optim.SGD(source.parameters(), lr=0.1))
        assert unwrap_model(model) is source
        path = dpkit.save_model(model, tmp_path / f"{strategy}.pt")
        assert set(torch.load(path, weights_only=True)) == set(source.state_dict())
        target = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        dpkit.load_model(target, path)
        assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), source.state_dict().values()))
        engine.close()


class Renamed(nn.Module):
    """A wrapper unwrap_model does not know, whose keys start with 'module.'."""

    def __init__(self, inner):
        super().__init__()
        self.module = inner


def test_load_into_an_unknown_prefixing_wrapper(tmp_path):
    source = nn.Linear(2, 3)
    dpkit.save_model(source, tmp_path / "m.pt")
    target = Renamed(nn.Linear(2, 3))
    dpkit.load_model(target, tmp_path / "m.pt")
    assert torch.equal(target.module.weight, source.weight)


# --- checkpoints that cannot rot ---------------------------------------------------------------------


def test_every_flipped_byte_is_an_error_naming_the_file(tmp_path):
    model = nn.Linear(4, 3)
    path = dpkit.save_model(model, tmp_path / "model.pt")
    good = path.read_bytes()
    assert torch.load(path, weights_only=True).keys() == model.state_dict().keys()  # still a plain torch file
    damaged = tmp_path / "damaged.pt"
    target = nn.Linear(4, 3)
    before = target.weight.clone()
    # every byte of the archive's first and last 256 (headers, pickle, zip directory, checksum), every 5th between
    positions = sorted(set(range(256)) | set(range(len(good) - 256, len(good))) | set(range(256, len(good), 5)))
    for position in positions:
        flipped = bytearray(good)
        flipped[position] ^= 0x20
        damaged.write_bytes(bytes(flipped))
        with pytest.raises(CheckpointCorruptError, match=r"damaged\.pt: .*restore it from a backup"):
            dpkit.load_model(target, damaged)
    assert torch.equal(target.weight, before)


def test_truncated_empty_and_foreign_files_name_the_path(tmp_path):
    good = dpkit.save_model(nn.Linear(4, 3), tmp_path / "model.pt").read_bytes()
    cases = {
        "empty.pt": b"",
        "truncated.pt": good[: len(good) // 2],
        "cut-tail.pt": good[:-10],
        "text.pt": b"these are not the weights you are looking for\n",
        "zip-head.pt": b"PK\x03\x04" + b"\x00" * 40,
        "pickle.pkl": __import__("pickle").dumps({"weight": [1.0, 2.0]}),
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointCorruptError, match=name.replace(".", r"\.")):
            dpkit.load_model(nn.Linear(4, 3), tmp_path / name)
    with pytest.raises(CheckpointCorruptError, match=r"empty \(0 bytes\)"):
        verify_file(tmp_path / "empty.pt")


def test_a_foreign_torch_file_loads_and_its_zip_crcs_are_checked(tmp_path):
    source = nn.Linear(4, 3)
    torch.save(source.state_dict(), tmp_path / "plain.pt")
    assert verify_file(tmp_path / "plain.pt") is False  # no dpkit checksum, but a sound archive
    target = dpkit.load_model(nn.Linear(4, 3), tmp_path / "plain.pt")
    assert torch.equal(target.weight, source.weight)
    data = bytearray((tmp_path / "plain.pt").read_bytes())
    offset = data.index(source.weight.detach().numpy().tobytes()[:8])  # inside the weight's record
    data[offset] ^= 1
    (tmp_path / "plain.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="CRC-32"):
        dpkit.load_model(nn.Linear(4, 3), tmp_path / "plain.pt")


def test_a_non_tensor_value_changes_nothing(tmp_path):
    state = nn.Linear(3, 4).state_dict()
    state["bias"] = "not a tensor"
    torch.save(state, tmp_path / "odd.pt")
    target = nn.Linear(3, 4)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match="bias: checkpoint holds a str"):
        dpkit.load_model(target, tmp_path / "odd.pt")
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_files_get_the_permissions_the_umask_gives(tmp_path):
    previous = os.umask(0o022)
    try:
        path = dpkit.save_model(nn.Linear(2, 2), tmp_path / "a.pt")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        os.umask(0o007)
        path = dpkit.save_model(nn.Linear(2, 2), tmp_path / "b.pt")
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
    finally:
        os.umask(previous)


@pytest.mark.parametrize("container", ["state_dict", "model"])
def test_load_model_reads_trainer_containers_and_says_which_key(tmp_path, caplog, container):
    source = nn.Linear(4, 3)
    wrapped = {f"module.{k}": v for k, v in source.state_dict().items()}  # pytorch/examples imagenet saves the DDP keys
    torch.save({"epoch": 7, container: wrapped, "optimizer": {"state": {}, "param_groups": []}}, tmp_path / "ckpt.pth")
    target = nn.Linear(4, 3)
    with caplog.at_level(logging.INFO, logger="dpkit"):
        dpkit.load_model(target, tmp_path / "ckpt.pth")
    assert torch.equal(target.weight, source.weight)
    assert f"'{container}' entry" in caplog.text


def test_strip_prefixes_is_public_and_uses_torch_semantics():
    state = {"module._orig_mod.0.weight": torch.ones(1), "module._orig_mod.0.bias": torch.zeros(1)}
    assert list(dpkit.strip_prefixes(state)) == ["0.weight", "0.bias"]


def test_unwrap_uses_types_not_names():
    class DataParallel(nn.Module):  # a user class that only shares torch's name
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(1, 1)

    lookalike = DataParallel()
    assert unwrap_model(lookalike) is lookalike


def test_safetensors_conversion_carries_a_checksum(tmp_path):
    pytest.importorskip("safetensors")
    from dpkit.checkpoint.model_files import write_safetensors

    source = nn.Linear(4, 3)
    path = write_safetensors(source.state_dict(), tmp_path / "model.safetensors")
    target = dpkit.load_model(nn.Linear(4, 3), path)
    assert torch.equal(target.weight, source.weight)
    data = bytearray(path.read_bytes())
    for position in (10, len(data) // 2, len(data) - 1):  # header and tensor bytes
        flipped = bytearray(data)
        flipped[position] ^= 0x01
        (tmp_path / "flipped.safetensors").write_bytes(bytes(flipped))
        with pytest.raises(CheckpointCorruptError, match="flipped.safetensors"):
            dpkit.load_model(nn.Linear(4, 3), tmp_path / "flipped.safetensors")


def _save_forever(path: str, state_dir: str | None) -> None:
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))
    if state_dir is None:
        while True:
            dpkit.save_model(model, path)
    engine = dpkit.Engine(strategy="single", accelerator="cpu", devices=1, progress=False)
    model, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    while True:
        engine.save_state(state_dir, keep=2)


@pytest.mark.parametrize("kind", ["model", "state"])
def test_saves_killed_at_random_moments_leave_the_previous_checkpoint(tmp_path, kind):
    """20 SIGKILLs of a process that saves in a loop, at random moments: every time, the checkpoint that was
    there still loads; the next save leaves no temporary file behind."""
    path, state_dir = tmp_path / "model.pt", tmp_path / "state"
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))
    dpkit.save_model(model, path)
    started = time.perf_counter()
    dpkit.save_model(model, path)
    save_seconds = time.perf_counter() - started
    context = multiprocessing.get_context("fork")
    rng = random.Random(0)
    for _ in range(20):
        saver = context.Process(target=_save_forever, args=(str(path), str(state_dir) if kind == "state" else None))
        saver.start()
        time.sleep(rng.uniform(0, 4 * save_seconds) + (0.05 if kind == "state" else 0.0))
        os.kill(saver.pid, signal.SIGKILL)
        saver.join()
        if kind == "model":
            dpkit.load_model(nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256)), path)
        elif state_dir.exists() and any(state_dir.glob("step-*")):
            engine = dpkit.Engine(strategy="single", accelerator="cpu", devices=1, progress=False)
            fresh = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))
            engine.setup(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9))
            engine.load_state(state_dir)
    if kind == "model":
        dpkit.save_model(model, path)
        assert sorted(os.listdir(tmp_path)) == ["model.pt"]
    else:
        engine = dpkit.Engine(strategy="single", accelerator="cpu", devices=1, progress=False)
        engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        engine.save_state(state_dir)
        assert sorted(os.listdir(state_dir)) == ["latest", "step-00000000"]


# --- dpkit ckpt --------------------------------------------------------------------------------------


def test_ckpt_inspect_prints_keys_shapes_dtypes_sizes_and_the_checksum(tmp_path, capsys):
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    dpkit.save_model(model, tmp_path / "model.pt")
    assert dpkit_main(["ckpt", "inspect", str(tmp_path / "model.pt")]) == 0
    out = capsys.readouterr().out
    assert "dpkit SHA-256 verified" in out
    assert (
        "0.weight               4x3     float32  48 B" in out and "1.num_batches_tracked  scalar  int64    8 B" in out
    )
    assert "7 tensors, 33 values, 136 B" in out


def test_ckpt_inspect_a_training_state(tmp_path, capsys):
    engine = dpkit.Engine(strategy="dp", accelerator="cpu", devices=2, progress=False)
    source = nn.Linear(3, 2)
    model, optimizer = engine.setup(source, torch.optim.SGD(source.parameters(), lr=0.5, momentum=0.9))
    for _ in range(3):
        optimizer.zero_grad()
        engine.backward(model(torch.ones(4, 3)).sum())
        optimizer.step()
    engine.save_state(tmp_path / "state", note="x")
    assert dpkit_main(["ckpt", "inspect", str(tmp_path / "state")]) == 0
    out = capsys.readouterr().out
    assert "training state: step 3, strategy dp on 1 process(es) (cpu:0, cpu:1)" in out
    assert "optimizer 0: 1 param group(s), lr 0.5, state for 2 parameter(s)" in out and "extras: note (value)" in out
    assert "weight  2x3    float32  24 B" in out


@pytest.mark.parametrize("safetensors", [False, True])
def test_ckpt_convert_strips_a_ddp_checkpoint(tmp_path, capsys, safetensors):
    if safetensors:
        pytest.importorskip("safetensors")
    source = nn.Linear(3, 2)
    torch.save(
        {"epoch": 1, "state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}}, tmp_path / "ddp.pth"
    )
    out = tmp_path / ("model.safetensors" if safetensors else "model.pt")
    assert (
        dpkit_main(
            ["ckpt", "convert", str(tmp_path / "ddp.pth"), str(out)] + (["--safetensors"] if safetensors else [])
        )
        == 0
    )
    assert "wrapper prefixes removed from 2" in capsys.readouterr().out
    if safetensors:
        from safetensors.torch import load_file

        converted = load_file(out)
    else:
        converted = torch.load(out, weights_only=True)
    fresh = nn.Linear(3, 2)
    fresh.load_state_dict(converted)  # strict, into the bare model
    assert torch.equal(fresh.weight, source.weight)


def test_ckpt_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty.pt").write_bytes(b"")
    assert dpkit_main(["ckpt", "inspect", str(tmp_path / "empty.pt")]) == 2
    assert dpkit_main(["ckpt", "inspect", str(tmp_path / "missing.pt")]) == 2
    torch.save(nn.Linear(1, 1).state_dict(), tmp_path / "m.pt")
    assert dpkit_main(["ckpt", "convert", str(tmp_path / "m.pt"), str(tmp_path)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(line.startswith("dpkit ckpt: error: ") for line in errors)
    assert "empty.pt" in errors[0] and "missing.pt" in errors[1] and "is a directory" in errors[2]
