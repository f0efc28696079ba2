import os

import pytest
import torch
from torch import nn

import dpkit
from dpkit.checkpoint import CheckpointMismatchError, atomic_save, strip_prefixes, unwrap_model


def small_model():
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def wrappers():
    return {
        "bare": lambda m: m,
        "dpkit": lambda m: dpkit.DataParallel(m, dpkit.cpu_devices(2)),
        "torch-dp": lambda m: nn.DataParallel(m),
        "compiled": lambda m: torch.compile(m),
        "compiled-dp": lambda m: dpkit.DataParallel(torch.compile(m), dpkit.cpu_devices(2)),
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
    assert unwrap_model(dpkit.DataParallel(torch.compile(nn.DataParallel(model)), dpkit.cpu_devices(1))) is model


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
    with pytest.raises(Exception, match="(?i)weights_only|unsupported global"):
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
