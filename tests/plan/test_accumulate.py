"""`dpkit plan --accumulate K`: an optimizer step of K micro-batches, the gradients exchanged once per step."""

import json

import pytest

from dpkit.cli.main import main
from dpkit.plan.catalogue import Catalogue
from dpkit.plan.configuration import Hardware
from dpkit.plan.cost_model import predict
from dpkit.plan.profiles import builtin_profile, given_profile

CATALOGUE = Catalogue.load()
TWO_NODES_10GBE = Hardware(CATALOGUE.gpu("h100-sxm"), CATALOGUE.link("nvlink4"), CATALOGUE.network("eth-10g"), 2)


def test_k_micro_batches_compute_k_times_and_exchange_once():
    profile = builtin_profile("gpt2-124m")
    one = predict(profile, TWO_NODES_10GBE, "ddp", 8, 4)
    four = predict(profile, TWO_NODES_10GBE, "ddp", 8, 4, accumulate=4)
    for phase in ("forward", "backward", "overhead"):
        assert four.breakdown[phase] == pytest.approx(4 * one.breakdown[phase])
    for phase in ("all_reduce", "optimizer"):  # once per step; what the last backward cannot hide is the same
        assert four.breakdown[phase] == pytest.approx(one.breakdown[phase])
    assert four.samples_per_second == pytest.approx(4 * 4 * 16 / four.step_seconds)
    assert four.samples_per_second > one.samples_per_second  # the exchange paid once for four micro-batches
    assert (four.accumulate, four.to_dict()["accumulate"]) == (4, 4)


def test_weights_dropped_after_each_pass_are_gathered_again_in_each_micro_batch():
    profile = builtin_profile("gpt2-124m")
    per_unit = [predict(profile, TWO_NODES_10GBE, "fsdp", 8, 4, accumulate=k).breakdown for k in (1, 3)]
    assert per_unit[1]["all_gather"] == pytest.approx(3 * per_unit[0]["all_gather"])
    assert per_unit[1]["reduce_scatter"] == pytest.approx(per_unit[0]["reduce_scatter"])
    for_the_step = [predict(profile, TWO_NODES_10GBE, "zero", 8, 4, options={"stage": 2}, accumulate=k) for k in (1, 3)]
    assert for_the_step[1].breakdown["all_gather"] == pytest.approx(for_the_step[0].breakdown["all_gather"])


def test_a_bad_accumulate_is_refused():
    with pytest.raises(ValueError, match="accumulate: expected a positive number of micro-batches"):
        predict(given_profile(1e6), TWO_NODES_10GBE, "ddp", 2, 4, accumulate=0)


def test_the_cli_plans_with_accumulate_and_refuses_a_bad_one(tmp_path, capsys):
    args = ["plan", "--params", "1e9", "--gpu", "h100-sxm", "--nodes", "2", "--network", "eth-10g"]
    args += ["--batch-size-per-device", "8", "--strategies", "single,ddp", "--device-counts", "8"]
    assert main([*args, "--accumulate", "0"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("dpkit plan: error: --accumulate: ")
    assert main([*args, "--accumulate", "8", "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "8 micro-batches per step" in out and "step: one optimizer step of 8 micro-batches" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["accumulate"] == 8 and {p["accumulate"] for p in plan["predictions"]} == {8}
