"""What a new user still tripped on (issue 36): an unknown flag, an exception of their own model, a batch smaller
than the devices, one vocabulary for the model flags, profile's table, the demo's report and run.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dpkit.cli.main import main
from dpkit.strategies import available_strategies

CPU2 = ["--accelerator", "cpu", "--devices", "2"]


def test_an_unknown_flag_is_refused_by_its_verb_with_the_nearest_flag(capsys):
    assert main(["train", "--stratgy", "dp"]) == 2
    assert capsys.readouterr().err.strip() == (
        "dpkit train: error: unrecognized arguments: --stratgy dp; did you mean --strategy? (see dpkit train --help)"
    )
    assert main(["ckpt", "inspect", "m.pt", "--verbse"]) == 2
    assert capsys.readouterr().err.strip() == (
        "dpkit ckpt inspect: error: unrecognized arguments: --verbse; did you mean --verbose? "
        "(see dpkit ckpt inspect --help)"
    )
    assert main(["profile", "--nothing-like-it"]) == 2  # no near flag: no guess
    assert capsys.readouterr().err.strip() == (
        "dpkit profile: error: unrecognized arguments: --nothing-like-it (see dpkit profile --help)"
    )


BROKEN = """\
from torch import nn


class Broken(nn.Module):
    def __init__(self, training_only=False, width=64):
        super().__init__()
        self.fc = nn.Linear(width, 10)
        self.training_only = training_only

    def forward(self, x):
        return self.helper(x)

    def helper(self, x):
        if self.training or not self.training_only:
            raise ValueError("my forward is broken on purpose")
        return self.fc(x)


def broken():
    return Broken()


def broken_in_training():
    return Broken(training_only=True)


def narrow():
    return nn.Sequential(nn.Linear(32, 10))
"""


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    (tmp_path / "frontdoor_broken.py").write_text(BROKEN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("frontdoor_broken", None)


def test_an_exception_of_the_users_forward_is_theirs_with_their_frames(tmp_path, capsys, user_models):
    argv = ["train", "--accelerator", "cpu", "--steps", "1", "--no-progress"]
    assert main([*argv, "--model", "frontdoor_broken:broken", "--out", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err.strip()
    assert "cannot take rows" not in err and len(err.splitlines()) == 1
    assert err.startswith("dpkit train: error: --model: the model's forward raised ValueError: my forward is broken")
    assert "frontdoor_broken.py:11 in forward -> frontdoor_broken.py:15 in helper: raise ValueError(" in err
    # raised in training only, past the probe, in a replica: still the user's, not bad input (exit 1, not 2)
    argv += [*CPU2[2:], "--strategy", "dp", "--model", "frontdoor_broken:broken_in_training"]
    assert main([*argv, "--out", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dpkit train: error in your code: in replica 0 on device cpu:0: ValueError: my forward")
    assert "frontdoor_broken.py:15 in helper: raise ValueError(" in err and "-v prints the traceback" in err


def test_a_model_that_does_not_fit_the_rows_is_still_said_as_a_shape(tmp_path, capsys, user_models):
    argv = ["train", "--accelerator", "cpu", "--model", "frontdoor_broken:narrow", "--out", str(tmp_path / "a")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpkit train: error: --model: the model cannot take rows of shape (64,) (RuntimeError: ")
    assert "shapes cannot be multiplied" in err


@pytest.mark.parametrize("strategy", ["dp", "ddp"])
def test_a_batch_smaller_than_the_devices_is_one_plain_sentence_for_dp_and_ddp(tmp_path, monkeypatch, capsys, strategy):
    import dpkit.recipe.recipe

    monkeypatch.setattr(dpkit.recipe.recipe, "relaunch", lambda *a, **k: pytest.fail("a process started"))
    argv = ["train", "--strategy", strategy, *CPU2, "--out", str(tmp_path / "run")]
    assert main([*argv, "--batch-size", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "dpkit train: error: --batch-size: 1 row(s) per step cannot give each of the 2 devices one, so a device "
        "would sit idle; give a batch of at least 2, or fewer devices"
    )
    assert main([*argv, "--batch-size", "1436"]) == 2  # the digits' 1437 rows leave a last batch of 1
    assert capsys.readouterr().err.strip() == (
        "dpkit train: error: --batch-size: 1436 leaves a last batch of 1 row(s) of the 1437 training rows, fewer "
        "than the 2 devices, so a device would sit idle in that step; give a batch size that leaves at least 2, "
        "such as 1435, or fewer devices"
    )
    assert not (tmp_path / "run").exists()


def test_profile_refuses_a_batch_smaller_than_the_devices_too(capsys):
    assert main(["profile", "--strategy", "dp", *CPU2, "--batch-size", "1"]) == 2
    assert "--batch-size: 1 row(s) per step cannot give each of the 2 devices one" in capsys.readouterr().err


def test_profile_takes_input_shape_and_plan_takes_one_strategy(tmp_path, capsys, monkeypatch):
    (tmp_path / "frontdoor_regressor.py").write_text(
        "from torch import nn\n\n\ndef build():\n    return nn.Sequential(nn.Linear(8, 4))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["profile", "--model", "frontdoor_regressor:build", "--input-shape", "8", "--strategy", "dp", *CPU2]
    assert main([*argv, "--steps", "1", "--warmup", "0", "--batch-size", "8", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("dpkit profile: frontdoor_regressor:build, strategy dp, batch 8")
    argv = ["plan", "--model", "gpt2-124m", "--gpu", "h100-sxm", "--batch-size-per-device", "8"]
    assert main([*argv, "--strategy", "ddp", "--device-counts", "1,2"]) == 0
    named = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.split()}
    assert named & set(available_strategies()) == {"ddp"}  # the table's rows: ddp's alone


def test_profiles_table_is_per_step_and_its_batch_is_trains():
    from dpkit.cli.main import build_parser
    from dpkit.observe.report import DeviceReport, Report
    from dpkit.recipe.config import TrainConfig
    from dpkit.tools.profile import ProfileSpec, global_batch_size

    # train's batch, except wide-output's 64 per device, where dp-balanced can even its devices out (issue 41)
    assert global_batch_size(ProfileSpec(example="digits"), 2) == TrainConfig.batch_size == 64
    from dpkit.cli.vocabulary import verb_parsers

    assert (
        "(default: 64, as train's;"
        in verb_parsers(build_parser())["profile"]._option_string_actions["--batch-size"].help
    )
    report = Report([DeviceReport("cpu:0", 32, 2**20, {"other": 2**20}, {"forward": 0.5, "backward": 1.0})], steps=2)
    lines = report.format_table().splitlines()
    assert lines[0].split()[:4] == ["device", "rows", "peak", "MiB"] and " ms" not in lines[0]  # memory alone
    assert lines[3] == "time by phase, ms per step (the mean of the 2 observed step(s)):"
    assert lines[4].split() == ["device", "forward", "ms", "backward", "ms"]
    assert lines[5].split() == ["cpu:0", "250.00", "500.00"]  # per step: 0.5 s and 1 s over 2 steps


def test_the_demo_prints_the_rows_and_memory_of_each_device_as_the_readme_says(tmp_path, capsys):
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert "the rows and memory of each device" in readme.replace("\n", " ")
    argv = ["demo", "--accelerator", "cpu", "--devices", "2", "--epochs", "1", "--no-progress", "--out", str(tmp_path)]
    assert main([*argv, "--no-compare"]) == 0  # (the ending, dp against ddp, is tests/cli/test_demo.py's)
    out = capsys.readouterr().out
    assert "the lesson's end" not in out
    lines = out.splitlines()
    header = lines.index("  device      rows  peak MiB")
    for line, device in zip(lines[header + 1 : header + 3], ("cpu:0", "cpu:1")):
        name, rows, peak = line.split()
        assert name == device and int(rows) > 0 and float(peak) > 0
    assert float(lines[header + 1].split()[2]) > float(lines[header + 2].split()[2])  # device 0 carries more


def test_run_json_records_the_strategy_and_devices(tmp_path, capsys):
    argv = ["train", "--strategy", "dp", *CPU2, "--steps", "1", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    settings = json.loads((tmp_path / "run.json").read_text())
    assert (settings["strategy"], settings["devices"], settings["processes"]) == ("dp", ["cpu:0", "cpu:1"], 1)


def test_an_operator_of_the_users_line_is_a_shape_and_their_own_raise_is_theirs():
    import torch
    from torch import nn

    from dpkit.recipe.sources import UserCodeError, check_model_fits

    class Matmul(nn.Module):
        def __init__(self, message=None):
            super().__init__()
            self.w, self.message = nn.Parameter(torch.zeros(32, 10)), message

        def forward(self, x):
            if self.message:
                raise RuntimeError(self.message)
            return x @ self.w  # raised by torch's operator under the user's own line

    x, y = torch.zeros(4, 64), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^model: the model cannot take rows of shape \(64,\) \(RuntimeError: "):
        check_model_fits(Matmul(), x, y)
    with pytest.raises(UserCodeError, match=r"^model: the model's forward raised RuntimeError: the size is wrong"):
        check_model_fits(Matmul("the size is wrong, says my own check"), x, y)  # their raise, whatever it says
