"""The recommendation: DP fine, DDP preferable, neither helps, nothing fits."""

from dpkit.plan.catalogue import Catalogue
from dpkit.plan.cost_model import Hardware
from dpkit.plan.planner import make_plan
from dpkit.plan.profiles import builtin_profile
from dpkit.strategies import Strategy, strategy_class

CATALOGUE = Catalogue.load()
ALL = ["single", "dp", "dp-balanced", "replicated", "ddp"]


def plan(model, gpu, link, devices, batch, precision="32", **hardware):
    machine = Hardware(CATALOGUE.gpu(gpu), CATALOGUE.link(link), **hardware)
    return make_plan(
        builtin_profile(model),
        machine,
        ALL,
        devices,
        batch,
        precision,
        links=CATALOGUE.links,
        networks=CATALOGUE.networks,
    )


def test_dp_is_fine_for_a_compute_heavy_model_on_two_nvlinked_gpus():
    result = plan("resnet101", "v100-sxm2", "nvlink2", [1, 2], 128)
    assert result.recommendation.strategy == "dp"
    assert "DP is fine" in result.recommendation.reasons[0]


def test_ddp_is_preferable_when_dp_pays_for_the_link():
    result = plan("gpt2-124m", "a100-80gb-pcie", "pcie4", [1, 2, 4, 8], 4, "bf16-mixed")
    assert result.recommendation.strategy == "ddp"
    assert any(reason.startswith("bottleneck link: pcie4") for reason in result.recommendation.reasons)
    assert any("with the fastest link" in reason for reason in result.recommendation.reasons)


def test_neither_helps_across_a_slow_network():
    result = plan(
        "gpt2-124m", "h100-sxm", "nvlink4", [1, 8], 8, "bf16-mixed", nodes=2, network=CATALOGUE.network("eth-10g")
    )
    assert result.recommendation.strategy == "single"
    reasons = " ".join(result.recommendation.reasons)
    assert "neither helps" in reasons and "eth-10g" in reasons and "fastest network" in reasons


def test_nothing_fits_says_to_shard():
    result = plan("llama-7b", "t4", "pcie3", [1, 2], 1, "16-mixed")
    assert "nothing fits" in result.recommendation.reasons[0] and "FSDP" in result.recommendation.reasons[0]


class DataParallelByAnotherName(Strategy):
    name = "torch-dp"
    traits = strategy_class("dp").traits


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
