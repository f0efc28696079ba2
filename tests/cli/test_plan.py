"""`dpkit plan`: predictions per strategy and device count, the recommendation, JSON in the issue's shape."""

import json
import sys
from pathlib import Path

import pytest

from dpkit.cli.main import main

sys.path.insert(0, str(Path(__file__).parents[1] / "plan"))  # the width factories


def plan(tmp_path, *args):
    out = tmp_path / "plan.json"
    assert main(["plan", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_json_has_the_contracted_shape_and_every_configuration(tmp_path):
    data = plan(
        tmp_path,
        "--model",
        "gpt2-124m",
        "--gpu",
        "h100-sxm",
        "--link",
        "nvlink4",
        "--devices",
        "1,2,4,8",
        "--batch-size-per-device",
        "8",
        "--precision",
        "bf16-mixed",
        "--png",
        str(tmp_path / "plan.png"),
    )
    keys = {
        "strategy",
        "devices",
        "nodes",
        "step_seconds",
        "samples_per_second",
        "speedup",
        "efficiency",
        "peak_bytes_per_device",
        "breakdown",
    }
    assert all(keys <= set(p) for p in data["predictions"])
    configurations = {(p["strategy"], p["devices"]) for p in data["predictions"]}
    assert ("single", 1) in configurations and ("ddp", 8) in configurations and ("dp", 4) in configurations
    dp8 = next(p for p in data["predictions"] if p["strategy"] == "dp" and p["devices"] == 8)
    assert len(dp8["peak_bytes_per_device"]) == 8 and dp8["peak_bytes_per_device"][0] > dp8["peak_bytes_per_device"][1]
    assert sum(dp8["breakdown"].values()) == pytest.approx(dp8["step_seconds"])
    assert data["recommendation"]["strategy"] in ("dp", "ddp", "replicated", "dp-balanced", "single")
    assert data["recommendation"]["reasons"]
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_slow_link_recommends_ddp_and_names_the_bottleneck(tmp_path, capsys):
    data = plan(
        tmp_path,
        "--model",
        "gpt2-124m",
        "--gpu",
        "h100-sxm",
        "--link",
        "pcie4",
        "--devices",
        "1,8",
        "--batch-size-per-device",
        "8",
        "--precision",
        "bf16-mixed",
    )
    assert data["recommendation"]["strategy"] == "ddp"
    reasons = " ".join(data["recommendation"]["reasons"])
    assert "bottleneck link: pcie4" in reasons and "DP reaches only" in reasons
    assert "recommendation: ddp" in capsys.readouterr().out


def test_a_factory_is_measured_and_numbers_can_be_given(tmp_path):
    measured = plan(
        tmp_path,
        "--model",
        "widths:narrow",
        "--input-shape",
        "64",
        "--gpu",
        "t4",
        "--link",
        "pcie3",
        "--batch-size-per-device",
        "32",
        "--devices",
        "1,2",
    )
    assert measured["model"]["parameters"] == 64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    given = plan(
        tmp_path,
        "--params",
        "125e6",
        "--flops-per-sample",
        "2.5e11",
        "--gpu",
        "a100-80gb-sxm",
        "--link",
        "nvlink3",
        "--batch-size-per-device",
        "16",
    )
    assert given["model"]["parameters"] == 125_000_000


def test_calibration_plans_this_machine(tmp_path):
    bench = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "--model",
                "widths:narrow",
                "--input-shape",
                "64",
                "--strategies",
                "single,dp",
                "--devices",
                "1,2",
                "--steps",
                "3",
                "--warmup",
                "1",
                "--observed-steps",
                "0",
                "--no-progress",
                "--json",
                str(bench),
            ]
        )
        == 0
    )
    data = plan(
        tmp_path,
        "--model",
        "widths:narrow",
        "--input-shape",
        "64",
        "--calibration",
        str(bench),
        "--batch-size-per-device",
        "64",
        "--devices",
        "1,2",
        "--strategies",
        "single,dp",
    )
    assert data["hardware"]["gpu"] == "virtual CPU device"
    assert "fitted" in data["constants"]["source"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt2-124m", "--gpu", "h100-sxm", "--batch-size-per-device", "8"], "--gpu/--link"),
        (["--model", "gpt2-124m", "--gpu", "h99", "--link", "nvlink4", "--batch-size-per-device", "8"], "h99"),
        (
            ["--model", "widths:narrow", "--gpu", "t4", "--link", "pcie3", "--batch-size-per-device", "8"],
            "--input-shape",
        ),
        (
            [
                "--model",
                "gpt2-124m",
                "--gpu",
                "t4",
                "--link",
                "pcie3",
                "--batch-size-per-device",
                "8",
                "--strategies",
                "fsdp",
            ],
            "fsdp",
        ),
        (
            ["--model", "gpt2-124m", "--gpu", "t4", "--link", "pcie3", "--batch-size-per-device", "8", "--nodes", "2"],
            "--network",
        ),
    ],
)
def test_bad_arguments_get_one_line(args, message, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
