"""`dpkit plan`: predictions per strategy and device count, the recommendation, JSON in the issue's shape."""

import json
import sys
from pathlib import Path

import pytest

from dpkit.cli.main import main
from dpkit.strategies import available_strategies, matching

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
    assert data["recommendation"]["strategy"] in available_strategies()
    assert data["recommendation"]["reasons"]
    assert all(p["fits"] and p["runs"] for p in data["predictions"])  # gpt2-124m fits an H100 under every strategy
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


SHARDED = matching(lambda traits: traits.sharded)[0]
LLAMA_ON_8_A100 = ["--model", "llama-7b", "--gpu", "a100-80gb-sxm", "--link", "nvlink3"]
LLAMA_ON_8_A100 += ["--batch-size-per-device", "1", "--devices", "8", "--precision", "bf16-mixed"]


def test_llama_7b_on_8_a100s_is_planned_sharded(tmp_path, capsys):
    # a whole LLaMA-7B with Adam is 16 bytes per parameter (108 GB) before activations: no strategy that keeps
    # a whole copy per device fits an 80 GB A100; sharded over 8 it does
    png = tmp_path / "plan.png"
    data = plan(tmp_path, *LLAMA_ON_8_A100, "--png", str(png))
    recommendation = data["recommendation"]
    assert recommendation["strategy"] == SHARDED == "fsdp" and recommendation["devices"] == 8
    assert recommendation["would_fit"] is None
    by_strategy = {p["strategy"]: p for p in data["predictions"]}
    assert set(by_strategy) == set(available_strategies()) - {"single"}  # single: one device, not asked
    assert [name for name, p in by_strategy.items() if p["fits"]] == [SHARDED]
    usable = 0.9 * 80 * 2**30
    assert max(by_strategy[SHARDED]["peak_bytes_per_device"]) <= usable
    assert all(max(p["peak_bytes_per_device"]) > usable for name, p in by_strategy.items() if name != SHARDED)
    assert {"all_gather", "reduce_scatter"} <= set(by_strategy[SHARDED]["breakdown"])
    out = capsys.readouterr().out
    assert f"recommendation: {SHARDED} on 8 devices" in out and f"only {SHARDED} fits" in out
    table = out.split("recommendation:")[0]
    assert any(
        line.split()[:3] == [SHARDED, "1", "8"] and not line.split()[-2].endswith("!") for line in table.splitlines()
    )
    assert png.stat().st_size > 0


def test_nothing_fits_is_no_strategy_in_the_json(tmp_path, capsys):
    data = plan(
        tmp_path,
        *LLAMA_ON_8_A100[:-4],
        "--devices",
        "1,2",
        "--precision",
        "bf16-mixed",
        "--strategies",
        "single,dp,ddp",
    )
    recommendation = data["recommendation"]
    assert recommendation["strategy"] is None and recommendation["devices"] is None
    assert recommendation["would_fit"]["strategy"] == SHARDED and recommendation["would_fit"]["devices"] > 2
    assert "recommendation: none" in capsys.readouterr().out


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
    assert given["model"]["largest_unit_parameters"] == 0  # unknown: planned as one unit
    seven_b = ["--params", "7e9", "--gpu", "a100-80gb-sxm", "--link", "nvlink3", "--batch-size-per-device", "1"]
    one_unit = plan(tmp_path, *seven_b, "--devices", "8")
    units = plan(tmp_path, *seven_b, "--devices", "8", "--largest-unit-params", "2e8")
    assert units["model"]["largest_unit_parameters"] == 200_000_000

    def sharded_peak(data):
        return next(max(p["peak_bytes_per_device"]) for p in data["predictions"] if p["strategy"] == SHARDED)

    # fp32, 4 bytes each: the whole model as one unit is its parameters and its gradient; units of 2e8 are
    # one's parameters, the next one's (prefetched) and one's gradient
    assert sharded_peak(one_unit) - sharded_peak(units) == pytest.approx(2 * 4 * 7e9 - 3 * 4 * 2e8, abs=8)


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
                "zero",
            ],
            "zero",
        ),
        (
            ["--model", "gpt2-124m", "--gpu", "t4", "--link", "pcie3", "--batch-size-per-device", "8"]
            + ["--largest-unit-params", "1e6"],
            "--largest-unit-params",
        ),
        (
            ["--params", "1e9", "--gpu", "t4", "--link", "pcie3", "--batch-size-per-device", "8"]
            + ["--largest-unit-params", "2e9"],
            "--largest-unit-params",
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
