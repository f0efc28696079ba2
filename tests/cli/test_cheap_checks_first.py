"""One ordering rule for every verb: what is cheap to check (flags, files, packages, folders, locks, the batch's
split over the devices) is refused before any probe, compile, process start or model build. Each case stubs the
verb's expensive step with one that fails the test, then gives one bad cheap value: the verb must refuse it in
one line, exit 2, and never reach the stub."""

from __future__ import annotations

import sys

import pytest

from dpkit.cli.main import main


def expensive(name: str):
    def reached(*args, **kwargs):
        raise AssertionError(f"{name} ran before a cheap check refused the input")

    return reached


def refused(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    err = err.strip()
    assert out == "" and len(err.splitlines()) == 1, (out, err)
    assert err.startswith(f"dpkit {argv[0]}: error: "), err
    return err


@pytest.fixture
def no_building(monkeypatch):
    """Model builds, auto's probe and process starts of train and profile fail the test."""
    import dpkit.recipe.checks
    import dpkit.recipe.recipe
    import dpkit.tools.profile

    for module in (dpkit.recipe.recipe, dpkit.tools.profile):
        monkeypatch.setattr(module, "model_source", expensive("a model build"))
        monkeypatch.setattr(module, "relaunch", expensive("a process start"))
    monkeypatch.setattr(dpkit.recipe.checks, "model_source", expensive("a model build"))
    monkeypatch.setattr(dpkit.recipe.recipe, "choose_strategy", expensive("auto's probe"))


def test_train_refuses_tensorboard_without_the_package_before_auto_probes(tmp_path, monkeypatch, capsys, no_building):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    argv = ["train", "--accelerator", "cpu", "--devices", "2", "--tensorboard", "--out", str(tmp_path / "run")]
    assert "--tensorboard: the tensorboard package is not installed" in refused(argv, capsys)
    assert not (tmp_path / "run").exists()


def test_train_refuses_a_folder_holding_a_run_before_auto_probes(tmp_path, capsys, no_building):
    (tmp_path / "model.pt").write_bytes(b"")
    argv = ["train", "--accelerator", "cpu", "--devices", "2", "--out", str(tmp_path)]
    assert "already holds a run (model.pt)" in refused(argv, capsys)


def test_train_refuses_a_folder_another_run_holds_before_auto_probes(tmp_path, capsys, no_building):
    from dpkit.recipe.folder import FolderLock

    lock = FolderLock(tmp_path).take()
    try:
        argv = ["train", "--accelerator", "cpu", "--devices", "2", "--out", str(tmp_path)]
        assert "is in use by another run" in refused(argv, capsys)
    finally:
        lock.release()


@pytest.mark.parametrize("strategy", [[], ["--strategy", "dp"], ["--strategy", "ddp"]])
def test_train_refuses_a_bad_value_before_building_or_starting_anything(tmp_path, capsys, no_building, strategy):
    argv = ["train", *strategy, "--accelerator", "cpu", "--devices", "2", "--lr", "-1", "--out", str(tmp_path)]
    assert "--lr: " in refused(argv, capsys)


@pytest.mark.parametrize("strategy", ["dp", "ddp"])
def test_profile_refuses_an_output_folder_before_building_or_starting_anything(tmp_path, capsys, no_building, strategy):
    argv = ["profile", "--strategy", strategy, "--accelerator", "cpu", "--devices", "2", "--json", str(tmp_path)]
    err = refused(argv, capsys)
    assert "--json: " in err and "is a folder" in err


def test_bench_refuses_an_output_folder_before_measuring(tmp_path, monkeypatch, capsys):
    import dpkit.cli.bench

    monkeypatch.setattr(dpkit.cli.bench, "run_bench", expensive("the bench"))
    argv = ["bench", "--accelerator", "cpu", "--device-counts", "1,2", "--png", str(tmp_path)]
    assert "--png: " in refused(argv, capsys)


def test_plan_refuses_an_output_folder_and_a_missing_calibration_before_measuring_the_model(
    tmp_path, monkeypatch, capsys
):
    import dpkit.cli.plan

    monkeypatch.setattr(dpkit.cli.plan, "measure_model", expensive("measuring the model"))
    argv = ["plan", "--example", "digits", "--gpu", "h100-sxm", "--batch-size", "64"]
    assert "--json: " in refused([*argv, "--json", str(tmp_path)], capsys)
    missing = str(tmp_path / "bench.json")
    assert "--calibration: no such file" in refused([*argv, "--calibration", missing], capsys)


def test_demo_refuses_an_out_that_is_a_file_before_training(tmp_path, monkeypatch, capsys):
    import dpkit.tools.demo

    monkeypatch.setattr(dpkit.tools.demo, "load_digits", expensive("the training"))
    (tmp_path / "file").write_text("")
    argv = ["demo", "--accelerator", "cpu", "--out", str(tmp_path / "file")]
    assert "--out: " in refused(argv, capsys)


def test_doctor_refuses_an_output_folder_before_measuring(tmp_path, monkeypatch, capsys):
    import dpkit.cli.doctor

    monkeypatch.setattr(dpkit.cli.doctor, "run_doctor", expensive("the measurements"))
    assert "--json: " in refused(["doctor", "--accelerator", "cpu", "--json", str(tmp_path)], capsys)


def test_launch_refuses_a_log_dir_it_cannot_make_before_starting_a_process(tmp_path, monkeypatch, capsys):
    import torch.distributed.launcher.api

    monkeypatch.setattr(torch.distributed.launcher.api, "elastic_launch", expensive("a process start"))
    (tmp_path / "script.py").write_text("print('hi')\n")
    (tmp_path / "file").write_text("")
    argv = ["launch", "--nproc-per-node", "1", "--log-dir", str(tmp_path / "file" / "logs")]
    assert "--log-dir: " in refused([*argv, str(tmp_path / "script.py")], capsys)


def test_ckpt_convert_refuses_an_output_it_cannot_write_before_reading_the_source(tmp_path, monkeypatch, capsys):
    import dpkit.cli.ckpt

    monkeypatch.setattr(dpkit.cli.ckpt, "read_checked", expensive("reading the checkpoint"))
    (tmp_path / "model.pt").write_bytes(b"")
    (tmp_path / "file").write_text("")
    argv = ["ckpt", "convert", str(tmp_path / "model.pt"), str(tmp_path / "file" / "clean.pt")]
    assert "OUT: " in refused(argv, capsys)


def test_catalogue_refuses_an_output_folder_before_printing(tmp_path, capsys):
    assert "--json: " in refused(["catalogue", "links", "--json", str(tmp_path)], capsys)
