"""`dpkit plan`: predictions per strategy and device count, the recommendation, JSON in the issue's shape."""

import json
import sys
from pathlib import Path

import pytest

from dpkit.cli.main import main
from dpkit.strategies import ALL_PROCESSES, Strategy, available_strategies, matching, strategy_class
from dpkit.strategies import SHARDED as SHARDED_PART

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
        "--device-counts",
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
        "--device-counts",
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


# the strategy that shards weights, gradients and optimizer state over every process (fsdp), whatever its name
SHARDED = matching(lambda traits: len(traits.sharded_parts) == 3 and traits.shard_group == ALL_PROCESSES)[0]
LLAMA_ON_8_A100 = ["--model", "llama-7b", "--gpu", "a100-80gb-sxm", "--link", "nvlink3"]
LLAMA_ON_8_A100 += ["--batch-size-per-device", "1", "--device-counts", "8", "--precision", "bf16-mixed"]


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
    # only what shards the weights too fits (fsdp, and hsdp, whose shard group is the node's 8 devices)
    weights_sharded = matching(lambda traits: traits.weights == SHARDED_PART)
    assert [name for name, p in by_strategy.items() if p["fits"]] == weights_sharded
    usable = 0.9 * 80 * 2**30
    assert max(by_strategy[SHARDED]["peak_bytes_per_device"]) <= usable
    assert all(max(p["peak_bytes_per_device"]) > usable for name, p in by_strategy.items() if not p["fits"])
    assert {"all_gather", "reduce_scatter"} <= set(by_strategy[SHARDED]["breakdown"])
    out = capsys.readouterr().out
    assert f"recommendation: {SHARDED} on 8 devices" in out and f"only {SHARDED}" in out
    table = out.split("recommendation:")[0]
    assert any(line.split()[:2] == [SHARDED, "8"] and not line.split()[-2].endswith("!") for line in table.splitlines())
    assert png.stat().st_size > 0


def test_nothing_fits_is_no_strategy_in_the_json(tmp_path, capsys):
    data = plan(
        tmp_path,
        *LLAMA_ON_8_A100[:-4],
        "--device-counts",
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
        "--device-counts",
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
    one_unit = plan(tmp_path, *seven_b, "--device-counts", "8")
    units = plan(tmp_path, *seven_b, "--device-counts", "8", "--largest-unit-params", "2e8")
    assert units["model"]["largest_unit_parameters"] == 200_000_000

    def sharded_peak(data):
        return next(max(p["peak_bytes_per_device"]) for p in data["predictions"] if p["strategy"] == SHARDED)

    # fp32, 4 bytes each: the whole model as one unit is its parameters and its gradient; units of 2e8 are
    # one's parameters, the next one's (prefetched) and one's gradient
    assert sharded_peak(one_unit) - sharded_peak(units) == pytest.approx(2 * 4 * 7e9 - 3 * 4 * 2e8, abs=8)


def test_calibration_plans_this_machine(tmp_path):
    from dpkit.tools.bench.run import run_bench
    from dpkit.tools.bench.spec import BenchSpec

    bench = tmp_path / "bench.json"
    spec = BenchSpec(
        example=None,
        model="widths:narrow",
        input_shape=(64,),
        strategies=["single", "dp"],
        device_counts=[1, 2],
        steps=3,
        warmup=1,
        observed_steps=0,
        progress=False,
    )
    run_bench(spec).save_json(bench)
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
        "--device-counts",
        "1,2",
        "--strategies",
        "single,dp",
    )
    assert data["hardware"]["gpu"] == "virtual CPU device"
    assert "fitted" in data["constants"]["source"]


GPT2 = ["--model", "gpt2-124m", "--gpu", "t4", "--link", "pcie3", "--batch-size-per-device", "8"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt2-124m", "--batch-size-per-device", "8"], "--gpu: name a GPU of the catalogue"),
        (["--model", "gpt2-124m", "--link", "pcie4", "--batch-size-per-device", "8"], "--gpu: --link joins GPUs"),
        (["--model", "gpt2-124m", "--gpu", "h99", "--batch-size-per-device", "8"], "`dpkit catalogue gpus` lists"),
        (["--model", "gpt2-124m", "--gpu", "t4", "--link", "nv9", "--batch-size-per-device", "8"], "--link: unknown"),
        (GPT2 + ["--nodes", "2", "--network", "smoke"], "--network: unknown network 'smoke'"),
        (["--model", "gpt2-124m", "--gpu", "t4"], "--batch-size: give the batch"),
        (GPT2 + ["--batch-size", "8"], "--batch-size"),
        (GPT2[:-2] + ["--batch-size", "4", "--device-counts", "1,8"], "--batch-size: 4 samples cannot give each of 8"),
        (GPT2 + ["--device-counts", "0,2"], "--device-counts: expected device counts"),
        (GPT2 + ["--devices", "1,2"], "--devices"),
        (GPT2 + ["--precision", "fp8"], "--precision"),
        (GPT2 + ["--optimizer", "lion"], "--optimizer"),
        (["--model", "widths:narrow", "--gpu", "t4", "--batch-size-per-device", "8"], "--input-shape"),
        (GPT2 + ["--strategies", "nonesuch"], "nonesuch"),
        (GPT2 + ["--largest-unit-params", "1e6"], "--largest-unit-params"),
        (
            ["--params", "1e9", "--gpu", "t4", "--batch-size-per-device", "8", "--largest-unit-params", "2e9"],
            "--largest-unit-params",
        ),
        (GPT2 + ["--nodes", "2"], "--network"),
        (GPT2 + ["--catalogue", "missing.json"], "--catalogue: catalogue file 'missing.json' does not exist"),
    ],
)
def test_bad_arguments_get_one_line(args, message, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_bad_arguments_are_refused_before_a_factory_is_measured(monkeypatch, capsys):
    import dpkit.cli.plan as plan_command

    def measured(*args, **kwargs):
        raise AssertionError("the factory was measured before the flags were checked")

    monkeypatch.setattr(plan_command, "measure_model", measured)
    factory = ["plan", "--model", "widths:narrow", "--input-shape", "64"]
    for bad, flag in (
        (["--gpu", "h99", "--batch-size-per-device", "8"], "--gpu"),
        (["--gpu", "t4", "--link", "nv9", "--batch-size-per-device", "8"], "--link"),
        (["--gpu", "t4", "--batch-size", "1"], "--batch-size"),
        (["--gpu", "t4"], "--batch-size"),
        (["--gpu", "t4", "--batch-size", "8", "--nodes", "2", "--network", "ib-9000g"], "--network"),
    ):
        assert main([*factory, *bad]) == 2
        assert capsys.readouterr().err.startswith(f"dpkit plan: error: {flag}: ")


def test_the_link_defaults_to_the_gpus_usual_one_and_says_so(tmp_path, capsys):
    data = plan(tmp_path, "--model", "gpt2-124m", "--gpu", "h100-sxm", "--batch-size-per-device", "8")
    assert data["hardware"]["link"] == "nvlink4" and data["link_assumed"] is True
    assert "link nvlink4 (the usual one for h100-sxm; --link to change)" in capsys.readouterr().out
    pcie = plan(tmp_path, "--model", "gpt2-124m", "--gpu", "h100-pcie", "--batch-size-per-device", "8")
    assert pcie["hardware"]["link"] == "pcie5"
    given = plan(
        tmp_path, "--model", "gpt2-124m", "--gpu", "h100-sxm", "--link", "pcie4", "--batch-size-per-device", "8"
    )
    out = capsys.readouterr().out
    assert given["hardware"]["link"] == "pcie4" and given["link_assumed"] is False
    assert "link pcie4 (not one of h100-sxm's links in the catalogue: nvlink4)" in out
    # and the advice offers the GPU's own faster link, by name
    assert "with nvlink4, the fastest link for h100-sxm" in " ".join(given["recommendation"]["reasons"])


def test_a_gpu_of_a_user_file_without_links_needs_link(tmp_path, capsys):
    mine = tmp_path / "mine.json"
    figures = {"peak_flops": {"32": 1e13, "tf32": 1e13, "bf16-mixed": 4e13, "16-mixed": 4e13}}
    figures |= {"memory_bytes": 16 * 2**30, "memory_bytes_per_second": 5e11}
    mine.write_text(json.dumps({"gpus": {"lab-gpu": figures}}))
    args = ["plan", "--model", "gpt2-124m", "--gpu", "lab-gpu", "--catalogue", str(mine), "--batch-size", "16"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--link: the catalogue names no usual link for lab-gpu" in err[0]
    assert "dpkit catalogue links" in err[0]
    data = plan(tmp_path, *args[1:], "--link", "pcie4")
    assert data["hardware"] == {"gpu": "lab-gpu", "link": "pcie4", "network": None, "nodes": 1}


def test_a_global_batch_is_split_across_each_device_count(tmp_path, capsys):
    args = ["--model", "resnet50", "--gpu", "a100-80gb-sxm", "--batch-size", "100", "--device-counts", "1,3,8"]
    data = plan(tmp_path, *args, "--strategies", "single,ddp")
    assert data["batch_size"] == 100 and data["batch_size_per_device"] is None
    shares = {p["devices"]: p["batch_size_per_device"] for p in data["predictions"] if p["strategy"] == "ddp"}
    assert shares == {1: 100, 3: 34, 8: 13}
    assert all(p["batch_size"] == 100 for p in data["predictions"])
    assert all(p["samples_per_second"] == pytest.approx(100 / p["step_seconds"]) for p in data["predictions"])
    out = capsys.readouterr().out
    assert "batch 100 in all" in out and "batch/dev" in out
    per_device = plan(tmp_path, *args[:-4], "--batch-size-per-device", "100", "--device-counts", "8")
    assert per_device["batch_size_per_device"] == 100 and per_device["predictions"][-1]["batch_size"] == 800


# the plan commands of README.md and docs/cost-model.md, and a wide one: every line fits 100 columns
DOCS_EXAMPLES = [
    "--model gpt2-124m --gpu h100-sxm --device-counts 1,2,4,8 --batch-size-per-device 8 --precision bf16-mixed",
    "--model gpt2-124m --gpu h100-sxm --device-counts 1,2,4,8 --batch-size-per-device 8",
    "--model llama-7b --gpu a100-80gb-sxm --batch-size-per-device 1 --device-counts 8 --precision bf16-mixed",
    "--model llama-7b --gpu t4 --batch-size-per-device 1 --device-counts 1,2 --precision 16-mixed",
    "--model gpt2-124m --gpu h100-sxm --batch-size 64 --device-counts 1,8 --nodes 2 --network eth-10g",
]


@pytest.mark.parametrize("command", DOCS_EXAMPLES)
def test_every_line_fits_100_columns(command, capsys):
    assert main(["plan", *command.split()]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 20 and max(map(len, lines)) <= 100, max(lines, key=len)


def test_the_verbs_own_examples_run_and_fit(tmp_path, monkeypatch, capsys):
    from dpkit.cli.plan import EXAMPLES

    monkeypatch.chdir(tmp_path)
    runnable = [example for example in EXAMPLES if "mypkg" not in example]
    assert len(runnable) >= 3
    for example in runnable:
        assert main(example.split()[1:]) == 0, example
        assert max(map(len, capsys.readouterr().out.splitlines())) <= 100, example


class LongNamed(Strategy):
    name = "ddp-under-a-name-long-enough-to-widen-every-table"
    traits = strategy_class("ddp").traits


def test_a_wide_plan_splits_its_tables_and_wraps_within_100_columns(tmp_path, monkeypatch, capsys):
    from dpkit import strategies

    registry = dict(strategies.STRATEGIES)
    registry[LongNamed.name] = f"{__name__}:LongNamed"
    monkeypatch.setattr(strategies, "STRATEGIES", registry)
    module = "a_model_module_with_a_name_as_long_as_they_come_in_research_code_" + "x" * 40
    (tmp_path / f"{module}.py").write_text(
        "from torch import nn\n\n\ndef build_the_model_with_every_option_spelled_out():\n"
        "    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    factory = f"{module}:build_the_model_with_every_option_spelled_out"
    args = ["plan", "--model", factory, "--input-shape", "64", "--gpu", "rtx-3090", "--batch-size", "4096"]
    args += ["--device-counts", "1,2,3,4,5,6,7,8,16,32", "--nodes", "16", "--network", "eth-10g"]
    assert main([*args, "--png", str(tmp_path / "wide.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    assert lines[0].startswith("dpkit plan: a_model_module")  # the long name wrapped, not cut
    phases = lines[next(i for i, line in enumerate(lines) if line.startswith("the step by phase")) :]
    assert sum(line.startswith("strategy") for line in phases) >= 2  # split into tables that fit
    assert any(line.split()[:2] == [LongNamed.name, "16x32"] for line in lines)


def test_every_registered_strategy_and_variant_gets_its_memory_by_category(tmp_path, capsys):
    # the default --strategies is the registry: a strategy registered later (zero, hsdp) is listed with no change
    # to the planner, and so is each variant it plans (zero's stage=2)
    data = plan(tmp_path, *GPT2, "--device-counts", "1,4")
    rows = data["memory_by_category"]
    expected = [
        (name, options) for name in available_strategies() for options in ({}, *strategy_class(name).planned_variants)
    ]
    assert [(row["strategy"], row["options"]) for row in rows] == expected
    for row in rows:
        kept = sum(row["bytes_by_category"][part] for part in ("parameters", "gradients", "optimizer_state"))
        assert 0 < kept <= row["peak_bytes"] == sum(row["bytes_by_category"].values())
        assert set(row["sharded"]) == set(strategy_class(row["strategy"]).traits_for(**row["options"]).sharded_parts)
    out = capsys.readouterr().out
    table = out.split("memory per device by category")[1].split("recommendation:")[0]
    assert all(name in table for name in available_strategies())


# ---- localsgd and diloco (issue 47): their settings, and the option beside the recommendation ----------------------

SLOW = ["--model", "gpt2-124m", "--gpu", "h100-sxm", "--nodes", "4", "--network", "eth-10g", "--device-counts", "8"]
SLOW += ["--batch-size-per-device", "1"]


@pytest.mark.parametrize(
    "settings, message",
    [
        (["--strategies", "ddp,fsdp", "--sync-every", "4"], "--sync-every: an option of strategy localsgd, diloco"),
        (["--strategies", "ddp,localsgd", "--outer-lr", "0.5"], "--outer-lr: an option of strategy diloco"),
        (["--strategies", "ddp,diloco", "--outer-lr", "-1"], "--outer-lr: expected a learning rate > 0, got -1"),
        (["--strategies", "diloco", "--outer-momentum", "1"], "--outer-momentum: expected a momentum in [0, 1), got 1"),
        (["--strategies", "localsgd", "--sync-every", "0"], "--sync-every: expected a positive int, got 0"),
    ],
)
def test_their_settings_out_of_place_or_range_get_one_line(settings, message, capsys):
    assert main(["plan", *SLOW, *settings]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_sync_every_sets_the_period_the_meeting_is_spread_over(tmp_path):
    def meeting_share(*settings):
        data = plan(tmp_path, *SLOW, "--strategies", "ddp,localsgd,diloco", *settings)
        periodic = {p["strategy"]: p for p in data["predictions"] if p["strategy"] != "ddp"}
        return {name: (p["options"], p["breakdown"]["all_reduce"]) for name, p in periodic.items()}

    default, every_four = meeting_share(), meeting_share("--sync-every", "4", "--outer-lr", "0.5")
    assert default["localsgd"][0] == {} and every_four["localsgd"][0] == {"sync_every": 4}
    assert every_four["diloco"][0] == {"sync_every": 4, "outer_lr": 0.5}
    for name in ("localsgd", "diloco"):  # the default period is 8: every 4 steps, each step carries twice as much
        assert every_four[name][1] == pytest.approx(2 * default[name][1])


def test_on_a_slow_link_the_plan_lists_them_as_an_option_and_on_a_fast_one_says_nothing_of_them(tmp_path, capsys):
    data = plan(tmp_path, *SLOW)
    out = capsys.readouterr().out
    rec = data["recommendation"]
    assert rec["strategy"] not in ("localsgd", "diloco")
    assert rec["periodic"]["strategies"] == ["localsgd", "diloco"] and rec["periodic"]["changes_optimization"]
    assert "  - localsgd/diloco every 8 steps would take the step from" in out
    assert "compare the quality on your model first\n    (docs/strategies.md)" in out
    assert max(map(len, out.splitlines())) <= 100
    fast = plan(tmp_path, "--model", "gpt2-124m", "--gpu", "h100-sxm", "--batch-size-per-device", "8")
    out = capsys.readouterr().out
    assert fast["recommendation"]["periodic"] is None
    assert "localsgd/diloco" not in out and "change the optimization" not in out


def test_a_plan_of_them_alone_names_no_strategy_and_says_why(tmp_path, capsys):
    data = plan(tmp_path, *SLOW, "--strategy", "localsgd")
    out = capsys.readouterr().out
    assert data["recommendation"]["strategy"] is None and data["recommendation"]["would_fit"] is None
    assert "recommendation: none\n  - localsgd changes the optimization" in out and "nothing fits" not in out
