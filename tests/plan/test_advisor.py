"""The recommendation: DP fine, DDP preferable, neither helps, only the sharded strategy fits, nothing fits."""

import pytest
from machines import memory

from dpkit.plan.advisor import recommend
from dpkit.plan.catalogue import Catalogue
from dpkit.plan.configuration import Hardware
from dpkit.plan.constants import CostConstants
from dpkit.plan.cost_model import Prediction
from dpkit.plan.lightest_sharding import SHARDING_WORTH
from dpkit.plan.planner import make_plan
from dpkit.plan.profiles import builtin_profile
from dpkit.strategies import ALL_PROCESSES, PER_DEVICE, Strategy, available_strategies, matching, strategy_class

CATALOGUE = Catalogue.load()
ALL = available_strategies()
UNSHARDED = matching(lambda traits: not traits.sharded)
# the strategy that shards weights, gradients and optimizer state over every process (fsdp), whatever its name
SHARDED = matching(lambda traits: len(traits.sharded_parts) == 3 and traits.shard_group == ALL_PROCESSES)[0]
UNSHARDED_PER_DEVICE = matching(lambda traits: traits.processes == PER_DEVICE and not traits.sharded)[0]


def plan(model, gpu, link, devices, batch, precision="32", strategies=ALL, seq_len=None, **hardware):
    machine = Hardware(CATALOGUE.gpu(gpu), CATALOGUE.link(link), **hardware)
    return make_plan(
        builtin_profile(model, seq_len=seq_len),
        machine,
        strategies,
        devices,
        batch,
        precision,
        links=CATALOGUE.links,
        networks=CATALOGUE.networks,
    )


def smallest_fitting_by_hand(model, gpu, batch, precision, seq_len=None):
    """The fewest devices on which the sharded strategy's fullest device is within the usable memory."""
    profile = builtin_profile(model, seq_len=seq_len)
    usable = CATALOGUE.gpu(gpu).memory_bytes * CostConstants().memory_headroom
    return next(n for n in range(1, 1025) if max(memory(profile, SHARDED, n, batch, precision)[0]) <= usable)


def test_dp_is_fine_for_a_compute_heavy_model_on_two_nvlinked_gpus():
    result = plan("resnet101", "v100-sxm2", "nvlink2", [1, 2], 128)
    assert result.recommendation.strategy == "dp"
    assert "DP is fine" in result.recommendation.reasons[0]


def test_ddp_is_preferable_when_dp_pays_for_the_link():
    result = plan("gpt2-124m", "a100-80gb-pcie", "pcie4", [1, 2, 4, 8], 4, "bf16-mixed", UNSHARDED)
    assert result.recommendation.strategy == "ddp"
    assert any(reason.startswith("bottleneck link: pcie4") for reason in result.recommendation.reasons)
    # an A100 PCIe card has no faster link in the catalogue: no link is offered, though faster ones exist
    assert CATALOGUE.gpu("a100-80gb-pcie").links == ("pcie4",)
    assert not any("link" in reason for reason in result.recommendation.reasons if "would change" in reason)


def link_advice(result):
    return [reason for reason in result.recommendation.reasons if "would change the answer: with" in reason][0]


def test_the_faster_link_advice_names_a_link_the_gpu_can_have():
    # an H100 SXM planned over PCIe 4: its own link, nvlink4, is offered and named, with what it would give
    result = plan("gpt2-124m", "h100-sxm", "pcie4", [1, 2, 4, 8], 4, "bf16-mixed", UNSHARDED)
    advice = link_advice(result)
    assert advice.startswith("what would change the answer: with nvlink4, the fastest link for h100-sxm: best ")
    nvlinked = plan("gpt2-124m", "h100-sxm", "nvlink4", [1, 2, 4, 8], 4, "bf16-mixed", UNSHARDED)
    best = max((p for p in nvlinked.predictions if p.devices == 8), key=lambda p: p.samples_per_second)
    assert f"best {best.strategy} {best.speedup:.2f}x" in advice  # the plan re-run on that link
    # an H100 PCIe card over PCIe 4 is offered its PCIe 5, not the NVLink of SXM boards
    pcie = link_advice(plan("gpt2-124m", "h100-pcie", "pcie4", [1, 2, 4, 8], 4, "bf16-mixed", UNSHARDED))
    assert "with pcie5, the fastest link for h100-pcie" in pcie and "nvlink" not in pcie
    # the RTX 3090's NVLink bridge joins two cards: offered on 2 devices, not on 8
    two = plan("gpt2-124m", "rtx-3090", "pcie4", [1, 2], 4, "bf16-mixed", UNSHARDED)
    assert "with nvlink-bridge, the fastest link for rtx-3090" in link_advice(two)
    eight = plan("gpt2-124m", "rtx-3090", "pcie4", [1, 8], 4, "bf16-mixed", UNSHARDED)
    assert not any("nvlink-bridge" in reason for reason in eight.recommendation.reasons)


def test_neither_helps_across_a_slow_network():
    result = plan(
        "gpt2-124m", "h100-sxm", "nvlink4", [1, 8], 8, "bf16-mixed", nodes=2, network=CATALOGUE.network("eth-10g")
    )
    assert result.recommendation.strategy == "single"
    reasons = " ".join(result.recommendation.reasons)
    assert "neither helps" in reasons and "eth-10g" in reasons and "fastest network" in reasons


def test_nothing_fits_without_a_sharded_strategy_says_to_shard(monkeypatch):
    from dpkit import strategies

    registry = {name: path for name, path in strategies.STRATEGIES.items() if name in UNSHARDED}
    monkeypatch.setattr(strategies, "STRATEGIES", registry)
    result = plan("llama-7b", "t4", "pcie3", [1, 2], 1, "16-mixed", UNSHARDED)
    assert result.recommendation.strategy is None and result.recommendation.devices is None
    assert "nothing fits" in result.recommendation.reasons[0] and "FSDP" in result.recommendation.reasons[1]


def usable_configurations(result):
    return {(p.strategy, p.total_devices) for p in result.predictions if p.fits and p.runs}


@pytest.mark.parametrize(
    "model, gpu, link, devices, batch, precision",
    [
        ("llama-7b", "a100-80gb-sxm", "nvlink3", [1, 2, 4, 8], 1, "bf16-mixed"),
        ("llama-7b", "h200-sxm", "nvlink4", [1, 2, 8], 1, "bf16-mixed"),
        ("gpt2-1.5b", "t4", "pcie3", [1, 2, 4, 8], 1, "bf16-mixed"),
        ("gpt2-1.5b", "a100-40gb-sxm", "nvlink3", [1, 2, 4], 4, "32"),
        ("bert-large", "v100-sxm2", "nvlink2", [1, 2, 4, 8], 64, "16-mixed"),
        ("resnet50", "t4", "pcie3", [1, 2, 4], 300, "32"),
        ("resnet50", "t4", "pcie3", [1, 2, 4], 64, "16-mixed"),
        ("gpt2-124m", "h100-sxm", "pcie4", [1, 8], 8, "bf16-mixed"),
        ("llama-7b", "t4", "pcie3", [1, 2], 1, "bf16-mixed"),
    ],
)
def test_the_recommendation_never_names_a_configuration_that_does_not_fit_or_run(
    model, gpu, link, devices, batch, precision
):
    result = plan(model, gpu, link, devices, batch, precision)
    usable = usable_configurations(result)
    choice = result.recommendation
    if usable:
        assert (choice.strategy, choice.devices) in usable
    else:
        assert choice.strategy is None and choice.devices is None and "nothing fits" in choice.reasons[0]


def test_only_the_sharded_strategy_fits_llama_7b_on_8_a100s():
    result = plan("llama-7b", "a100-80gb-sxm", "nvlink3", [1, 2, 4, 8], 1, "bf16-mixed", UNSHARDED + [SHARDED])
    choice = result.recommendation
    assert choice.strategy == SHARDED and choice.devices == 8  # the most devices asked: throughput
    assert all(not p.fits for p in result.predictions if p.strategy in UNSHARDED)
    fitting = sorted(p.devices for p in result.predictions if p.fits)
    assert fitting == [4, 8] and all(p.strategy == SHARDED for p in result.predictions if p.fits)
    # the reasons say that only it fits, and from how many devices (3: not a count that was asked)
    smallest = smallest_fitting_by_hand("llama-7b", "a100-80gb-sxm", 1, "bf16-mixed")
    assert smallest == 3
    assert choice.reasons[0].startswith(f"only {SHARDED} fits")
    assert f"{SHARDED} fits from {smallest} devices" in choice.reasons[1]


def test_only_the_sharded_strategy_fits_on_the_devices_asked():
    # asked for 2 devices only: the sharded strategy does not fit there, so nothing fits, and the reasons
    # name the device count on which it would
    result = plan("llama-7b", "a100-80gb-sxm", "nvlink3", [1, 2], 1, "bf16-mixed")
    choice = result.recommendation
    smallest = smallest_fitting_by_hand("llama-7b", "a100-80gb-sxm", 1, "bf16-mixed")
    assert choice.strategy is None and choice.devices is None
    assert choice.would_fit["strategy"] == SHARDED and choice.would_fit["devices"] == smallest
    assert any(
        reason.startswith(f"more devices: {SHARDED}") and f"{smallest} devices" in reason for reason in choice.reasons
    )
    assert choice.to_dict()["strategy"] is None


def test_nothing_fits_names_what_would_and_no_strategy():
    # LLaMA-7B on 16 GB T4s: one sample's activations at 2048 tokens outgrow the device, so neither more
    # devices nor CPU offload nor a smaller batch makes any strategy fit, and the reasons say so
    result = plan("llama-7b", "t4", "pcie3", [1, 2], 1, "bf16-mixed")
    choice = result.recommendation
    assert choice.strategy is None and choice.devices is None
    assert choice.to_dict()["strategy"] is None
    reasons = " ".join(choice.reasons)
    assert "nothing fits" in choice.reasons[0]
    assert f"no device count makes {SHARDED} fit" in reasons and "CPU offload" in reasons
    assert "not even 1 sample per device" in reasons
    assert choice.would_fit == {"strategy": SHARDED, "devices": None, "offload": False, "batch_size_per_device": None}
    # shorter sequences: more devices would make the sharded strategy fit
    shorter = plan("llama-7b", "t4", "pcie3", [1, 2], 1, "bf16-mixed", seq_len=512).recommendation
    smallest = smallest_fitting_by_hand("llama-7b", "t4", 1, "bf16-mixed", seq_len=512)
    assert shorter.strategy is None and shorter.would_fit["devices"] == smallest > 2
    # and CPU offload would: the device holds what is gathered and the activations only
    assert shorter.would_fit["offload"] is True
    assert any("CPU offload" in reason and "which fits" in reason for reason in shorter.reasons)


def test_nothing_fits_in_16_mixed_says_the_sharded_strategy_needs_bf16():
    result = plan("llama-7b", "a100-80gb-sxm", "nvlink3", [1, 8], 1, "16-mixed")
    sharded = [p for p in result.predictions if p.strategy == SHARDED]
    assert sharded and all(p.fits and not p.runs for p in sharded if p.devices == 8)
    choice = result.recommendation
    assert choice.strategy is None
    assert any("bf16-mixed" in reason for reason in choice.reasons[1:])


def prediction(strategy, devices, samples_per_second, fits=True):
    return Prediction(
        strategy, devices, 1, 1, 1.0 / samples_per_second, {"forward": 1.0}, [1], 1,
        samples_per_second=samples_per_second, speedup=samples_per_second, efficiency=samples_per_second / devices,
        fits=fits,
    )  # fmt: skip


@pytest.mark.parametrize("edge", [1.05, 1.25])
def test_where_a_whole_copy_fits_sharding_must_be_clearly_faster(edge):
    predictions = [
        prediction("single", 1, 1.0),
        prediction(UNSHARDED_PER_DEVICE, 8, 6.0),
        prediction(SHARDED, 8, 6.0 * edge),
    ]
    choice = recommend(predictions)
    assert choice.strategy == (SHARDED if edge >= SHARDING_WORTH else UNSHARDED_PER_DEVICE)
    assert choice.devices == 8
    words = "faster than" if edge >= SHARDING_WORTH else "too little for sharding"
    assert words in choice.reasons[1]


def test_a_configuration_that_does_not_fit_is_never_the_fastest_recommended():
    predictions = [
        prediction("single", 1, 1.0),
        prediction(UNSHARDED_PER_DEVICE, 4, 3.5),
        prediction(UNSHARDED_PER_DEVICE, 8, 7.0, fits=False),
        prediction(SHARDED, 8, 6.0),
    ]
    choice = recommend(predictions)
    assert (choice.strategy, choice.devices) == (SHARDED, 8)
    # and when one device does not fit, it is never the "neither helps" answer
    predictions = [prediction("single", 1, 1.0, fits=False), prediction(SHARDED, 2, 1.02)]
    assert (recommend(predictions).strategy, recommend(predictions).devices) == (SHARDED, 2)


class DataParallelByAnotherName(Strategy):
    name = "torch-dp"
    traits = strategy_class("dp").traits


class ShardedByAnotherName(Strategy):
    name = "zero-3"
    traits = strategy_class(SHARDED).traits


def test_the_advisor_finds_dataparallel_by_its_traits(monkeypatch):
    # the registry without "dp" but with its traits under another name: the advisor's DataParallel is that one
    from dpkit import strategies

    registry = {name: path for name, path in strategies.STRATEGIES.items() if name != "dp"}
    registry["torch-dp"] = f"{__name__}:DataParallelByAnotherName"
    monkeypatch.setattr(strategies, "STRATEGIES", registry)
    machine = Hardware(CATALOGUE.gpu("v100-sxm2"), CATALOGUE.link("nvlink2"))
    result = make_plan(
        builtin_profile("resnet101"),
        machine,
        ["single", "torch-dp", "ddp"],
        [1, 2],
        128,
        links=CATALOGUE.links,
        networks=CATALOGUE.networks,
    )
    assert result.recommendation.strategy == "torch-dp"
    assert result.recommendation.reasons[0].startswith("DP is fine here")


def test_the_advisor_finds_the_sharded_strategy_by_its_traits(monkeypatch):
    from dpkit import strategies

    registry = {name: path for name, path in strategies.STRATEGIES.items() if name in UNSHARDED}
    registry["zero-3"] = f"{__name__}:ShardedByAnotherName"
    monkeypatch.setattr(strategies, "STRATEGIES", registry)
    result = plan("llama-7b", "a100-80gb-sxm", "nvlink3", [1, 8], 1, "bf16-mixed", list(registry))
    assert (result.recommendation.strategy, result.recommendation.devices) == ("zero-3", 8)
    nothing = plan("llama-7b", "a100-80gb-sxm", "nvlink3", [1, 2], 1, "bf16-mixed", list(registry))
    assert nothing.recommendation.strategy is None and nothing.recommendation.would_fit["strategy"] == "zero-3"
