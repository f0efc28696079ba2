"""The recommendation and compression: without --compress it names the compression that pays where the exposed
communication is the largest part of the step, and says why none pays where computing is; with --compress it says
what the compression changes; and its reasons cite the term that decides (the 2-node, 10 GbE plan of issue 44)."""

import json

import pytest

from dpkit.cli.main import main
from dpkit.plan.advice_words import milliseconds
from dpkit.plan.advisor import recommend, why_faster
from dpkit.plan.catalogue import Catalogue
from dpkit.plan.compression_advice import advise_compression, exchange_seconds
from dpkit.plan.configuration import Hardware
from dpkit.plan.cost_model import Prediction, predict
from dpkit.plan.planner import make_plan
from dpkit.plan.profiles import builtin_profile, given_profile

CATALOGUE = Catalogue.load()
TWO_NODES_10GBE = Hardware(CATALOGUE.gpu("h100-sxm"), CATALOGUE.link("nvlink4"), CATALOGUE.network("eth-10g"), 2)
ALL = ["single", "dp", "ddp", "fsdp", "zero", "hsdp"]


def plan_of(profile, hardware, batch, strategies=ALL, counts=(1, 2, 4, 8), **changes):
    return make_plan(
        profile, hardware, strategies, list(counts), batch, links=CATALOGUE.links, networks=CATALOGUE.networks,
        **changes,
    )  # fmt: skip


def chosen(plan):
    rec = plan.recommendation
    return next(p for p in plan.predictions if p.strategy == rec.strategy and p.total_devices == rec.devices)


def test_bandwidth_bound_the_recommendation_names_the_compression_that_pays():
    profile = given_profile(1e9)
    plan = plan_of(profile, TWO_NODES_10GBE, 8)
    rec, best = plan.recommendation, chosen(plan)
    assert exchange_seconds(best) > best.breakdown["forward"] + best.breakdown["backward"]  # bandwidth-bound
    assert rec.compress == "bf16"  # hsdp takes 16 bits, not PowerSGD
    compressed = predict(profile, TWO_NODES_10GBE, best.strategy, best.devices, 8, compression="bf16")
    line = next(reason for reason in rec.reasons if reason.startswith("bf16 halves the bytes"))
    assert f"{milliseconds(exchange_seconds(best))} -> {milliseconds(exchange_seconds(compressed))}" in line
    assert f"of a {milliseconds(best.step_seconds)} step" in line
    assert f"the step {milliseconds(compressed.step_seconds)}" in line
    # ddp with PowerSGD would be faster still: named, with the flag that plans it
    ddp = predict(profile, TWO_NODES_10GBE, "ddp", 8, 8, compression="powersgd:4")
    rival = next(reason for reason in rec.reasons if reason.startswith("with compression ddp on 16 devices"))
    assert f"to {milliseconds(ddp.step_seconds)}" in rival and "--compress powersgd:4" in rival
    assert plan.to_dict()["recommendation"]["compress"] == "bf16"


def test_compute_bound_compression_would_not_pay_and_says_which_term_decides():
    plan = plan_of(builtin_profile("resnet50"), Hardware(CATALOGUE.gpu("h100-sxm"), CATALOGUE.link("nvlink4")), 128)
    rec, best = plan.recommendation, chosen(plan)
    assert rec.compress is None and plan.to_dict()["recommendation"]["compress"] is None
    computing = best.breakdown["forward"] + best.breakdown["backward"]
    line = next(reason for reason in rec.reasons if reason.startswith("compression would not pay"))
    assert "compute-bound" in line and f"forward and backward take {milliseconds(computing)}" in line


def test_with_compress_the_recommendation_says_what_it_changes():
    plan = plan_of(given_profile(1e9), TWO_NODES_10GBE, 8, compression="powersgd:4")
    rec, best = plan.recommendation, chosen(plan)
    assert (rec.strategy, rec.compress, best.compress) == ("ddp", "powersgd:4", "powersgd:4")
    uncompressed = predict(given_profile(1e9), TWO_NODES_10GBE, "ddp", 8, 8)
    line = next(reason for reason in rec.reasons if reason.startswith("powersgd:4 sends rank-4 factors"))
    assert f"of a {milliseconds(uncompressed.step_seconds)} step" in line and "after its warm-up" in line
    # on a fast link, compute-bound, PowerSGD's own work costs more than the bytes it saves (epfml/powersgd#17)
    nvlinked = Hardware(CATALOGUE.gpu("h100-sxm"), CATALOGUE.link("nvlink4"))
    fast = plan_of(builtin_profile("resnet50"), nvlinked, 128, ["single", "ddp"], (1, 8), compression="powersgd:4")
    line = next(reason for reason in fast.recommendation.reasons if reason.startswith("powersgd:4 sends"))
    assert chosen(fast).breakdown["compress"] > 0 and line.endswith("; it costs more than it saves here")
    # a recommended strategy that does not take the compression asked says so
    hsdp_only = plan_of(given_profile(1e9), TWO_NODES_10GBE, 8, ["single", "hsdp"], compression="powersgd")
    assert hsdp_only.recommendation.compress is None
    assert any("hsdp takes no powersgd:2" in reason for reason in hsdp_only.recommendation.reasons)


def test_the_reason_for_sharding_cites_the_deciding_term_not_the_optimizer_state():
    # issue 44: 2 nodes over 10 GbE, a 1B model: hsdp beats ddp by its all-reduce, not by its optimizer step
    plan = plan_of(given_profile(1e9), TWO_NODES_10GBE, 8)
    hsdp = next(p for p in plan.predictions if p.strategy == "hsdp" and p.devices == 8)
    ddp = next(p for p in plan.predictions if p.strategy == "ddp" and p.devices == 8)
    reason = next(reason for reason in plan.recommendation.reasons if reason.startswith("hsdp is "))
    figures = f"{milliseconds(hsdp.breakdown['all_reduce'])} against ddp's {milliseconds(ddp.breakdown['all_reduce'])}"
    assert f"its exposed all-reduce takes {figures}" in reason
    assert "optimizer state" not in reason
    assert "among its 2 replicas" in reason and "all 16 processes" in reason


def prediction(strategy, breakdown, devices=8):
    step = sum(breakdown.values())
    return Prediction(strategy, devices, 1, 1, step, breakdown, [1], 1, samples_per_second=1 / step,
                      speedup=1 / step, efficiency=1 / step / devices)  # fmt: skip


def test_where_the_optimizer_step_decides_the_reason_says_so_with_its_figures():
    whole = prediction("ddp", {"forward": 0.1, "all_reduce": 0.01, "optimizer": 0.05})
    sharded = prediction("zero", {"forward": 0.1, "all_gather": 0.02, "optimizer": 0.005})
    assert why_faster(sharded, whole) == (
        "each device steps only its shard of the optimizer state (the optimizer step 5.00 ms against ddp's 50.0 ms)"
    )
    choice = recommend([prediction("single", {"forward": 1.0}, 1), whole, sharded])
    assert choice.strategy == "zero" and "faster than ddp: each device steps only its shard" in choice.reasons[1]


def test_one_device_and_strategies_that_take_none_get_no_compression():
    alone = prediction("single", {"forward": 1.0}, devices=1)
    never = pytest.fail  # the rerun must not be called where nothing applies
    assert advise_compression(alone, None, never).compress is None
    dp = prediction("dp", {"forward": 0.1, "replicate": 0.5})
    assert advise_compression(dp, None, never).compress is None


def test_the_cli_prints_the_compress_column_and_the_json_field(tmp_path, capsys):
    args = ["plan", "--params", "1e9", "--gpu", "h100-sxm", "--nodes", "2", "--network", "eth-10g"]
    args += ["--batch-size-per-device", "8", "--device-counts", "8", "--compress", "powersgd:4"]
    assert main([*args, "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("strategy") and "compress" in line)
    assert header.split()[:3] == ["strategy", "devices", "compress"]
    assert "none: fsdp, hsdp take no powersgd:4, predicted uncompressed" in " ".join(out.split())
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["compress"] == "powersgd:4" and plan["recommendation"]["compress"] == "powersgd:4"
    assert {p["strategy"]: p["compress"] for p in plan["predictions"] if p["devices"] == 8}["ddp"] == "powersgd:4"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--compress", "zip"], "--compress: expected none, bf16, fp16, powersgd or powersgd:R"),
        (["--compress", "powersgd:0"], "--compress: the rank of 'powersgd:0' is not a positive int"),
        (["--compress", "bf16", "--strategies", "single,dp"], "--compress: bf16 is taken by none of the planned"),
        (["--compress", "powersgd", "--strategies", "single,fsdp"], "powersgd goes with replicated, ddp, zero"),
    ],
)
def test_a_compression_no_planned_strategy_takes_is_one_line(capsys, extra, words):
    args = ["plan", "--params", "1e8", "--gpu", "h100-sxm", "--batch-size-per-device", "8", *extra]
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpkit plan: error: --compress: ") and words in lines[0], lines
