"""Replicas trained alone that meet every H steps (localsgd, diloco; issue 47) in the planner: the step averaged
over a period (no gradient exchange per step, 1/H of the meeting), their memory (an anchor instead of DDP's buckets,
diloco's outer optimizer, the meeting's buffers), and the advice: never recommended nor picked by `auto`, listed as
an option with the caveat where every-step synchronization dominates even with the best compression."""

from dataclasses import replace

import pytest
from machines import memory

from dpkit.plan.advice_words import milliseconds
from dpkit.plan.auto import choose_strategy
from dpkit.plan.auto_candidates import CHANGES_THE_OPTIMIZATION
from dpkit.plan.catalogue import Catalogue
from dpkit.plan.compression_advice import largest_part
from dpkit.plan.configuration import Hardware, Setup
from dpkit.plan.cost_model import predict
from dpkit.plan.memory import memory_by_category
from dpkit.plan.periodic_advice import CAVEAT
from dpkit.plan.periodic_sync import meets_periodically, periodic_strategies
from dpkit.plan.planner import make_plan
from dpkit.plan.profiles import builtin_profile, given_profile
from dpkit.plan.transfers import ring_all_reduce_seconds
from dpkit.strategies import available_strategies

CATALOGUE = Catalogue.load()
NETWORK = CATALOGUE.network("eth-10g")
TWO_NODES_10GBE = Hardware(CATALOGUE.gpu("h100-sxm"), CATALOGUE.link("nvlink4"), NETWORK, 2)
FOUR_NODES_10GBE = replace(TWO_NODES_10GBE, nodes=4)
ONE_NODE_NVLINK = Hardware(CATALOGUE.gpu("h100-sxm"), CATALOGUE.link("nvlink4"))
BILLION = given_profile(1e9)
P = BILLION.parameters
LOCALSGD, DILOCO = periodic_strategies()  # in the registry's order: plain averaging first, then the outer step
PER_STEP_PHASES = ("forward", "backward", "loss", "optimizer", "overhead")


def meeting_exchange_seconds(wire_bytes, processes=16, link=NETWORK):
    """One meeting's all-reduces: the moves (`wire_bytes`), and three of a few bytes (rows, step marks, spread)."""
    return ring_all_reduce_seconds(link, wire_bytes, processes) + 3 * ring_all_reduce_seconds(
        link, 8 * processes, processes
    )


def test_the_periodic_strategies_are_found_from_their_options_not_their_names():
    assert periodic_strategies() == ["localsgd", "diloco"]
    assert not any(meets_periodically(name) for name in available_strategies() if name not in ("localsgd", "diloco"))


@pytest.mark.parametrize("period", [1, 8, 32])
def test_localsgd_steps_as_ddp_without_its_exchange_and_carries_one_h_th_of_a_meeting(period):
    ddp = predict(BILLION, TWO_NODES_10GBE, "ddp", 8, 8)
    local = predict(BILLION, TWO_NODES_10GBE, LOCALSGD, 8, 8, options={"sync_every": period})
    for phase in PER_STEP_PHASES:
        assert local.breakdown.get(phase) == pytest.approx(ddp.breakdown.get(phase)), phase
    # no gradient exchange per step: the whole all-reduce of the moves (nothing hides it) once every H steps
    assert local.breakdown["all_reduce"] == pytest.approx(meeting_exchange_seconds(4 * P) / period)
    assert 0 < local.breakdown["meeting"] < 0.01 * local.breakdown["all_reduce"] * period
    meeting = local.breakdown["all_reduce"] + local.breakdown["meeting"]
    assert local.step_seconds == pytest.approx(ddp.step_seconds - ddp.breakdown["all_reduce"] + meeting)
    if period == 8:  # issue 47's 2 nodes over 10 GbE: the exchange dominates ddp's step, localsgd's much less
        assert local.step_seconds < ddp.step_seconds / 4


def test_the_meeting_is_compressed_as_asked_and_so_is_its_share_of_the_compression_work():
    for kind, wire_bytes in (("bf16", 2 * P), ("fp16", 2 * P)):
        ddp = predict(BILLION, TWO_NODES_10GBE, "ddp", 8, 8, compression=kind)
        local = predict(BILLION, TWO_NODES_10GBE, LOCALSGD, 8, 8, compression=kind)
        assert local.compress == kind
        assert local.breakdown["all_reduce"] == pytest.approx(meeting_exchange_seconds(wire_bytes) / 8)
        assert local.breakdown["compress"] == pytest.approx(ddp.breakdown["compress"] / 8)
    powersgd = predict(BILLION, TWO_NODES_10GBE, LOCALSGD, 8, 8, compression="powersgd:4")
    assert powersgd.breakdown["all_reduce"] < local.breakdown["all_reduce"] / 50


def test_diloco_exchanges_what_localsgd_does_and_adds_its_outer_step_to_the_meeting():
    local = predict(BILLION, TWO_NODES_10GBE, LOCALSGD, 8, 8)
    outer = predict(BILLION, TWO_NODES_10GBE, DILOCO, 8, 8)
    assert outer.breakdown["all_reduce"] == pytest.approx(local.breakdown["all_reduce"])
    assert local.breakdown["meeting"] < outer.breakdown["meeting"] < 2 * local.breakdown["meeting"]


def test_accumulation_counts_the_meeting_once_per_optimizer_step():
    once = predict(BILLION, TWO_NODES_10GBE, LOCALSGD, 8, 8)
    four = predict(BILLION, TWO_NODES_10GBE, LOCALSGD, 8, 8, accumulate=4)
    for phase in ("all_reduce", "meeting", "optimizer"):
        assert four.breakdown[phase] == pytest.approx(once.breakdown[phase])
    assert four.breakdown["forward"] == pytest.approx(4 * once.breakdown["forward"])


def categories(strategy, batch, **options):
    return memory_by_category(Setup(BILLION, TWO_NODES_10GBE, strategy, 8, batch, options=options))[0]


def test_memory_an_anchor_in_place_of_ddps_buckets_and_diloco_keeps_three_more_copies():
    ddp, local, outer = (categories(name, 8) for name in ("ddp", LOCALSGD, DILOCO))
    assert ddp["gradient_buckets"] == 4 * P and ddp["anchor_weights"] == ddp["outer_optimizer"] == 0
    assert local["gradient_buckets"] == 0 and local["anchor_weights"] == 4 * P and local["outer_optimizer"] == 0
    # diloco's outer SGD: its weights, the pseudo-gradient torch keeps on them, its Nesterov momentum
    assert outer["anchor_weights"] == 4 * P and outer["outer_optimizer"] == 12 * P
    assert categories(DILOCO, 8, outer_momentum=0.0)["outer_optimizer"] == 8 * P  # no momentum buffer
    for name in ("parameters", "gradients", "optimizer_state", "activations"):
        assert local[name] == outer[name] == ddp[name]


def test_a_meeting_needs_its_buffers_where_the_steps_activations_were():
    # at a batch whose activations (about 1.9 GiB a sample here) exceed the meeting's four copies, the step's peak
    # is the peak: localsgd's equals ddp's (the anchor where the buckets were), and so does the largest batch
    for batch in (8, 16):
        assert memory(BILLION, LOCALSGD, 8, batch)[0] == memory(BILLION, "ddp", 8, batch)[0]
    assert predict(BILLION, TWO_NODES_10GBE, LOCALSGD, 8, 8).max_batch_per_device == (
        predict(BILLION, TWO_NODES_10GBE, "ddp", 8, 8).max_batch_per_device
    )
    # with no activations the meeting sets the peak: the state, the anchor and four copies of the weights
    assert memory(BILLION, "ddp", 8, 0)[0][0] == (4 + 4 + 8 + 4) * P
    assert memory(BILLION, LOCALSGD, 8, 0)[0][0] == (4 + 4 + 8 + 4 + 16) * P
    assert memory(BILLION, DILOCO, 8, 0)[0][0] == (4 + 4 + 8 + 4 + 12 + 16) * P
    for batch in (0, 1, 4, 8):  # the categories add up to the peak, the meeting's or the step's
        peaks, _ = memory(BILLION, LOCALSGD, 8, batch)
        assert sum(categories(LOCALSGD, batch).values()) == pytest.approx(peaks[0], abs=8)


# ---- the advice ---------------------------------------------------------------------------------------------------


def plan_of(profile, hardware, batch, counts, strategies=None, **changes):
    names = strategies or available_strategies()
    return make_plan(
        profile, hardware, names, counts, batch, links=CATALOGUE.links, networks=CATALOGUE.networks, **changes
    )


def slow_link_plan(**changes):
    """gpt2-124m over 4 nodes of 8 H100s joined by 10 GbE, one sample per device: even PowerSGD leaves ddp's step
    mostly all-reduce."""
    return plan_of(builtin_profile("gpt2-124m"), FOUR_NODES_10GBE, 1, [8], **changes)


def option_line(plan):
    return next((reason for reason in plan.recommendation.reasons if reason.startswith("localsgd/diloco")), None)


def test_on_a_slow_link_they_are_an_option_with_their_figures_and_the_caveat_never_the_recommendation():
    plan = slow_link_plan()
    rec = plan.recommendation
    fastest = max(plan.predictions, key=lambda p: p.samples_per_second)
    assert meets_periodically(fastest.strategy)  # the fastest predicted of all, and still not recommended
    assert rec.strategy is not None and not meets_periodically(rec.strategy)
    periodic = plan.to_dict()["recommendation"]["periodic"]
    before = periodic["instead_of"]
    # the fastest every-step configuration with the compression the advice names for it (as in its rival line)
    assert (before["strategy"], before["compress"], before["devices"]) == ("ddp", "powersgd:4", 32)
    assert "with compression ddp on 32 devices would be faster still: powersgd:4" in " ".join(rec.reasons)
    best = predict(builtin_profile("gpt2-124m"), FOUR_NODES_10GBE, "ddp", 8, 1, compression="powersgd:4")
    assert largest_part(best)[0] == "communication"  # dominated by its synchronization even with the best
    assert before["step_seconds"] == pytest.approx(best.step_seconds)
    options = {option["strategy"]: option for option in periodic["options"]}
    assert list(options) == ["localsgd", "diloco"] and periodic["changes_optimization"] is True
    steps = {}
    for name, option in options.items():
        again = predict(builtin_profile("gpt2-124m"), FOUR_NODES_10GBE, name, 8, 1, compression="powersgd:4")
        assert option["step_seconds"] == pytest.approx(again.step_seconds) and option["sync_every"] == 8
        steps[name] = milliseconds(again.step_seconds)
    line = option_line(plan)
    assert line.startswith(f"localsgd/diloco every 8 steps would take the step from {milliseconds(best.step_seconds)}")
    assert f"to {steps['localsgd']} (localsgd) and {steps['diloco']} (diloco)" in line and line.endswith(CAVEAT)
    # no other line names them: not the rival with compression, nor what would change the answer
    others = [reason for reason in rec.reasons if reason != line]
    assert not any(name in reason for name in ("localsgd", "diloco") for reason in others), others


def test_with_a_compression_asked_their_meetings_carry_it_against_the_fastest_with_it():
    plan = slow_link_plan(compression="bf16")
    periodic = plan.recommendation.periodic
    every_step = [p for p in plan.predictions if not meets_periodically(p.strategy)]
    fastest = min(every_step, key=lambda p: p.step_seconds)
    assert (fastest.strategy, fastest.compress) == ("hsdp", "bf16")
    assert periodic["instead_of"]["strategy"] == "hsdp" and periodic["instead_of"]["compress"] == "bf16"
    assert [option["compress"] for option in periodic["options"]] == ["bf16", "bf16"]
    assert "(hsdp with bf16, the fastest that synchronizes every step)" in option_line(plan)


def test_their_period_is_the_one_planned():
    four = {"sync_every": 4}
    plan = slow_link_plan(strategy_options={"localsgd": four, "diloco": four})
    assert option_line(plan).startswith("localsgd/diloco every 4 steps would take the step from")
    assert [option["sync_every"] for option in plan.recommendation.periodic["options"]] == [4, 4]


def test_nothing_about_them_where_the_step_is_compute_bound_or_the_best_compression_makes_it_so():
    fast = plan_of(builtin_profile("gpt2-124m"), ONE_NODE_NVLINK, 8, [1, 8])
    # a 1B model over 10 GbE at 8 per device: bound by its all-reduce uncompressed, by computing with PowerSGD
    relieved = plan_of(BILLION, TWO_NODES_10GBE, 8, [8])
    uncompressed = next(p for p in relieved.predictions if p.strategy == "ddp")
    assert largest_part(uncompressed)[0] == "communication"
    for plan in (fast, relieved):
        assert plan.recommendation.periodic is None and plan.to_dict()["recommendation"]["periodic"] is None
        assert not any("localsgd" in reason or "diloco" in reason for reason in plan.recommendation.reasons)


def test_a_plan_of_them_alone_recommends_nothing_and_says_why():
    plan = plan_of(builtin_profile("gpt2-124m"), FOUR_NODES_10GBE, 1, [8], strategies=["localsgd", "diloco"])
    rec = plan.recommendation
    assert rec.strategy is None and rec.devices is None and not rec.nothing_fits
    assert rec.reasons == [
        "localsgd, diloco change the optimization (each replica trains alone between meetings): the recommendation "
        "never names one; plan them beside a strategy that synchronizes every step, e.g. --strategies "
        "ddp,localsgd,diloco"
    ]
    assert plan.recommendation_lines()[0] == "recommendation: none"


def test_auto_never_picks_them_even_where_they_are_the_fastest():
    a100s = Hardware(CATALOGUE.gpu("a100-80gb-sxm"), CATALOGUE.link("nvlink3"))
    fastest = {name: 1.0 for name in available_strategies()} | {LOCALSGD: 0.01, DILOCO: 0.01}
    choice = choose_strategy(SMALL, None, 64, ["cuda:0", "cuda:1"], hardware=a100s, step_seconds=fastest)
    assert not meets_periodically(choice.strategy)
    for name in (LOCALSGD, DILOCO):
        candidate = choice.candidate(name)
        assert not candidate.eligible and candidate.note == CHANGES_THE_OPTIMIZATION
    assert "localsgd" not in choice.reason and "diloco" not in choice.reason


SMALL = given_profile(1e6, 1e8, name="small", kernels_per_forward=20, output_bytes_per_sample=40.0)
