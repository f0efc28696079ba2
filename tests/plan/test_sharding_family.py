"""The sharding family predicted from its traits: what each strategy shards, over which group, decides its memory by
category (the ZeRO paper's formulas) and its communication, and `auto` and the advisor take the lightest sharding
that fits. The strategies here are made up from traits alone, registered under names no code compares."""

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import dpkit
from dpkit import strategies
from dpkit.plan.advisor import recommend
from dpkit.plan.auto import choose_strategy
from dpkit.plan.catalogue import Catalogue, Link
from dpkit.plan.configuration import Hardware, Setup
from dpkit.plan.constants import OPTIMIZER_STATE_BYTES_PER_PARAMETER
from dpkit.plan.cost_model import predict
from dpkit.plan.memory import memory_by_category
from dpkit.plan.planner import make_plan
from dpkit.plan.profiles import builtin_profile, given_profile
from dpkit.strategies import (
    ALL_PROCESSES,
    FOR_THE_STEP,
    ONE_NODE,
    PER_UNIT,
    SHARDED,
    Strategy,
    strategy_class,
)

CATALOGUE = Catalogue.load()
DDP_TRAITS = strategy_class("ddp").traits  # a process per device, nothing sharded


def made_up(name, **sharding):
    """A strategy class with ddp's traits but for what `sharding` says it shards."""
    traits = dataclasses.replace(DDP_TRAITS, **sharding)
    return type(name.title().replace("-", ""), (Strategy,), {"name": name, "traits": traits, "__module__": __name__})


# (name, what it shards): ZeRO-1, ZeRO-2 with whole weights, ZeRO-2 as FSDP2 without resharding after forward,
# ZeRO-3 (fsdp), hybrid sharding within a node and within pairs of processes
FAMILY = {
    "whole": {},
    "optimizer-only": {"optimizer_state": SHARDED},
    "gradients-too": {"gradients": SHARDED, "optimizer_state": SHARDED},
    "kept-gathered": {"weights": SHARDED, "gathers": FOR_THE_STEP, "gradients": SHARDED, "optimizer_state": SHARDED},
    "everything": {"weights": SHARDED, "gathers": PER_UNIT, "gradients": SHARDED, "optimizer_state": SHARDED},
    "per-node": {
        "weights": SHARDED,
        "gathers": PER_UNIT,
        "gradients": SHARDED,
        "optimizer_state": SHARDED,
        "shard_group": ONE_NODE,
    },
    "in-pairs": {
        "weights": SHARDED,
        "gathers": PER_UNIT,
        "gradients": SHARDED,
        "optimizer_state": SHARDED,
        "shard_group": 2,
    },
}
CLASSES = {name: made_up(name, **sharding) for name, sharding in FAMILY.items()}
globals().update({cls.__name__: cls for cls in CLASSES.values()})  # where the registry finds them


@pytest.fixture
def family(monkeypatch):
    for name, cls in CLASSES.items():
        monkeypatch.setitem(strategies.STRATEGIES, name, f"{__name__}:{cls.__name__}")
    return list(CLASSES)


def shard_size(sharding, per_node, nodes):
    """The processes a shard spans, from what the strategy declares (the test's own reading of the traits)."""
    group = sharding.get("shard_group", ALL_PROCESSES)
    return {ALL_PROCESSES: per_node * nodes, ONE_NODE: per_node}.get(group, group)


def machine(nodes=1, shared=False, link=None):
    link = link or CATALOGUE.link("nvlink4")
    return Hardware(CATALOGUE.gpu("h100-sxm"), link, CATALOGUE.network("ib-200g") if nodes > 1 else None, nodes, shared)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("per_node, nodes", [(2, 1), (4, 1), (8, 1), (4, 2)])
def test_each_part_is_whole_or_one_shard_of_its_group(family, optimizer, per_node, nodes):
    # float32 weights and gradients (4 bytes each) and the optimizer's K bytes per parameter (8 for Adam's two
    # moments, 4 for SGD's momentum), each divided by the shard group's size where the strategy shards it
    profile = builtin_profile("gpt2-1.5b")
    psi, k = profile.parameters, OPTIMIZER_STATE_BYTES_PER_PARAMETER[optimizer]
    for name, sharding in FAMILY.items():
        group = shard_size(sharding, per_node, nodes)
        setup = Setup(profile, machine(nodes), name, per_node, 1, optimizer=optimizer)
        got = memory_by_category(setup)
        assert len(got) == per_node and all(device == got[0] for device in got), name  # every process alike
        for part, per_parameter in (("parameters", 4), ("gradients", 4), ("optimizer_state", k)):
            key = {"parameters": "weights"}.get(part, part)
            divided = sharding.get(key) == SHARDED
            assert got[0][part] == pytest.approx(per_parameter * psi / (group if divided else 1), abs=1), (name, part)


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_the_zero_papers_totals_per_device(family, devices):
    # Rajbhandari et al. 2020, figure 1, with Adam (16 bytes per parameter in all) and dpkit's float32 weights and
    # gradients: ddp 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N, stage 3 16Ψ/N; hybrid 16Ψ/S
    profile = builtin_profile("gpt2-1.5b")
    psi, n = profile.parameters, devices
    expected = {
        "whole": 16 * psi,
        "optimizer-only": 8 * psi + 8 * psi / n,
        "gradients-too": 4 * psi + 12 * psi / n,
        "kept-gathered": 16 * psi / n,
        "everything": 16 * psi / n,
        "per-node": 16 * psi / n,  # one node: the node is every process
        "in-pairs": 16 * psi / 2,
    }
    for name, total in expected.items():
        got = memory_by_category(Setup(profile, machine(), name, devices, 1))[0]
        assert got["parameters"] + got["gradients"] + got["optimizer_state"] == pytest.approx(total, abs=3), name


def test_what_is_gathered_follows_how_the_weights_are_gathered(family):
    profile = builtin_profile("llama-7b")
    unit, psi = profile.unit_parameters, profile.parameters
    for precision, gathered_bytes in (("32", 4), ("bf16-mixed", 2)):
        got = {name: memory_by_category(Setup(profile, machine(), name, 8, 1, precision))[0] for name in FAMILY}
        # a unit and the next one prefetched, in the gather dtype, and a unit's whole float32 gradient
        assert got["everything"]["gathered_parameters"] == pytest.approx(2 * unit * gathered_bytes + 4 * unit, abs=1)
        # kept from forward to backward: the whole model at the peak
        assert got["kept-gathered"]["gathered_parameters"] == pytest.approx(psi * gathered_bytes + 4 * unit, abs=1)
        assert got["gradients-too"]["gathered_parameters"] == pytest.approx(4 * unit, abs=1)
        assert got["whole"]["gathered_parameters"] == got["optimizer-only"]["gathered_parameters"] == 0
        # whole weights keep autocast's 16-bit copies under mixed precision; gathered ones are 16-bit already
        copies = 2 * psi if precision == "bf16-mixed" else 0
        assert [got[name]["autocast_copies"] for name in FAMILY] == [copies, copies, copies, 0, 0, 0, 0]
        # whole gradients are all-reduced through DDP's buckets, a second copy
        assert got["whole"]["gradient_buckets"] == got["optimizer-only"]["gradient_buckets"] == 4 * psi
        assert got["gradients-too"]["gradient_buckets"] == 0


def communication(name, devices, nodes=1, precision="32"):
    """The collectives' phases where nothing overlaps (one pool of cores) and latency is nil: bytes / bandwidth."""
    link = Link("no latency", 10e9, 10e9, 0.0, "test")
    hardware = dataclasses.replace(machine(nodes, shared=True, link=link), network=link if nodes > 1 else None)
    phases = predict(builtin_profile("gpt2-124m", seq_len=1024), hardware, name, devices, 1, precision).breakdown
    return {phase: phases.get(phase, 0.0) for phase in ("all_reduce", "all_gather", "reduce_scatter")}


@pytest.mark.parametrize("devices", [2, 4])
def test_communication_is_two_psi_for_ddp_and_stages_1_and_2_and_three_for_stage_3(family, devices):
    # Rajbhandari et al. 2020, section 7: an all-reduce (a reduce-scatter and an all-gather) moves 2Ψ per device;
    # stages 1 and 2 a reduce-scatter of the gradients and an all-gather of the weights, 2Ψ; stage 3 gathers the
    # weights in forward and again in backward, 3Ψ
    whole = communication("whole", devices)
    assert set(k for k, v in whole.items() if v) == {"all_reduce"}
    two_psi = whole["all_reduce"]
    for name, volume in (("optimizer-only", 2), ("gradients-too", 2), ("kept-gathered", 2), ("everything", 3)):
        got = communication(name, devices)
        assert got["all_reduce"] == 0 and got["all_gather"] > 0 and got["reduce_scatter"] > 0, name
        assert sum(got.values()) == pytest.approx(two_psi * volume / 2), name
    # mixed precision gathers 16-bit weights under stage 3; the gradients are reduced in float32
    mixed = communication("everything", devices, precision="bf16-mixed")
    assert mixed["all_gather"] == pytest.approx(communication("everything", devices)["all_gather"] / 2)


def test_hybrid_sharding_gathers_within_its_group_and_all_reduces_the_shards_across(family):
    # on 2 nodes of 4: gathers and reduce-scatters over the node's 4 processes (3Ψ over a group of 4); the nodes'
    # shards all-reduced over the network, which the 4 groups' rings share: the whole gradient's 2Ψ over 2
    hybrid, fsdp_like = communication("per-node", 4, nodes=2), communication("everything", 4, nodes=2)
    ring = lambda n: (n - 1) / n  # noqa: E731  (a ring's share of the bytes each device moves)
    psi_seconds = communication("whole", 2)["all_reduce"] / (2 * ring(2))  # Ψ's float32 bytes over the link
    assert hybrid["all_gather"] + hybrid["reduce_scatter"] == pytest.approx(3 * ring(4) * psi_seconds)
    assert fsdp_like["all_gather"] + fsdp_like["reduce_scatter"] == pytest.approx(3 * ring(8) * psi_seconds)
    assert hybrid["all_reduce"] == pytest.approx(2 * ring(2) * psi_seconds)
    assert fsdp_like["all_reduce"] == 0


# ---- choosing: the lightest sharding that fits -----------------------------------------------------------------

# 3.2 billion parameters and little else: with Adam a whole copy and DDP's buckets (20 bytes per parameter, 64 GB) do
# not fit a 40 GB A100's usable 36 GiB; sharding the optimizer state over 8 (8 + 4 + 1 = 13 bytes, 42 GB) does not
# either; sharding the gradients too (4 + 1.5 bytes and a unit's gradient, 18 GB) does
BIG = given_profile(3.2e9, 1e9, name="big", activation_bytes_per_sample=1e6, largest_unit_parameters=1e8)
A100_40 = Hardware(CATALOGUE.gpu("a100-40gb-sxm"), CATALOGUE.link("nvlink3"))
EIGHT_GPUS = [f"cuda:{i}" for i in range(8)]


@pytest.fixture
def registry(monkeypatch):
    """The registry of the reference, ddp and the strategies named, nothing else."""

    def use(*names):
        kept = {name: path for name, path in strategies.STRATEGIES.items() if name in ("single", "ddp")}
        kept.update({name: f"{__name__}:{CLASSES[name].__name__}" for name in names})
        monkeypatch.setattr(strategies, "STRATEGIES", kept)
        return list(kept)

    return use


def auto(names):
    equal = {name: 0.01 for name in names} | {"single": 1.0}  # every multi-device strategy as fast
    return choose_strategy(BIG, None, 8, EIGHT_GPUS, "32", "adam", hardware=A100_40, step_seconds=equal)


def test_auto_takes_the_lightest_sharding_that_fits_whatever_the_registry_holds(registry):
    names = registry("everything")
    first = auto(names)
    assert first.strategy == "everything" and "nothing unsharded fits" in first.reason
    # a strategy that shards less, registered after it: it fits too, and it is chosen, with no change to plan/
    names = registry("everything", "gradients-too", "optimizer-only")
    second = auto(names)
    assert not second.candidate("optimizer-only").fits and second.candidate("gradients-too").fits
    assert second.strategy == "gradients-too"
    # a more sharded strategy wins only when clearly faster
    faster = {name: 0.01 for name in names} | {"single": 1.0, "everything": 0.008}
    chosen = choose_strategy(BIG, None, 8, EIGHT_GPUS, "32", "adam", hardware=A100_40, step_seconds=faster)
    assert chosen.strategy == "everything"


def test_the_advisor_recommends_the_lightest_sharding_that_fits(registry):
    names = registry("everything", "gradients-too", "optimizer-only")
    plan = make_plan(BIG, A100_40, names, [1, 8], 1)
    fitting = {p.strategy for p in plan.predictions if p.fits}
    assert fitting == {"everything", "gradients-too"}
    choice = plan.recommendation
    assert (choice.strategy, choice.devices) == ("gradients-too", 8)
    assert choice.reasons[0].startswith("only gradients-too and everything fit: gradients-too shards gradients and ")
    # predicted alike but for the sharding: the lighter one, whatever the order of the predictions
    assert recommend(list(reversed(plan.predictions))).strategy == "gradients-too"


def test_nothing_fitting_suggests_the_lightest_sharding_that_would(registry):
    names = registry("everything", "gradients-too", "optimizer-only")
    plan = make_plan(BIG, A100_40, ["single", "ddp"], [1, 2], 1)  # only the unsharded asked: nothing fits
    assert plan.recommendation.strategy is None
    # gradients-too and everything both fit from 2 devices on: the lighter one is suggested
    would_fit = plan.recommendation.would_fit
    assert (would_fit["strategy"], would_fit["devices"]) == ("gradients-too", 2)
    assert "optimizer-only" in names  # (registered, and fits only from 10 devices on)


# ---- plan/ predicts from traits and imports no strategy --------------------------------------------------------

PLAN = Path(dpkit.__file__).parent / "plan"
# what plan/ may import of strategies/: the registry and the traits, the rule of the units a sharded strategy
# gathers (a helper of the sharding strategies, not one of them), and the compression value (what --compress names)
ALLOWED = {"dpkit.strategies", "dpkit.strategies.base", "dpkit.strategies.units", "dpkit.strategies.compression"}


def test_plan_imports_no_strategy_module():
    found = {}
    for path in sorted(PLAN.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dpkit.strategies"):
                found.setdefault(node.module, []).append(path.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("dpkit.strategies"):
                        found.setdefault(alias.name, []).append(path.name)
    assert "dpkit.strategies" in found  # (the check sees plan's imports)
    assert set(found) <= ALLOWED, {module: files for module, files in found.items() if module not in ALLOWED}
    # and importing every module of plan/ loads none of the registered strategies (nor their helpers)
    modules = [f"dpkit.plan.{path.stem}" for path in PLAN.glob("*.py") if path.stem != "__init__"]
    registered = sorted({path.split(":")[0] for path in strategies.STRATEGIES.values()})
    code = (
        f"import sys\nfor m in {modules!r}: __import__(m)\n"
        f"print(sorted(m for m in sys.modules if m.startswith('dpkit.strategies.') and m not in {sorted(ALLOWED)!r}))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr
    assert registered  # (what it would have named)
