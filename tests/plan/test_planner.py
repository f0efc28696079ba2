"""The plan as it is shown: tables within 100 columns, and a figure whose equal lines stay visible."""

import dataclasses

import pytest

from dpkit.plan.catalogue import Catalogue
from dpkit.plan.configuration import BatchSize, Hardware, Setup
from dpkit.plan.memory import memory_by_category
from dpkit.plan.planner import PHASE_HEADERS, equal_lines, make_plan
from dpkit.plan.profiles import builtin_profile
from dpkit.plan.tables import WIDTH, fitted_table, table, table_wrapping_last, wrap
from dpkit.strategies import SHARDED, Strategy, available_strategies, strategy_class

CATALOGUE = Catalogue.load()


def resnet_plan(strategies=None, counts=(1, 2, 4, 8), batch=64):
    profile = builtin_profile("resnet50")
    machine = Hardware(CATALOGUE.gpu("v100-sxm2"), CATALOGUE.link("nvlink2"))
    return make_plan(profile, machine, strategies or available_strategies(), list(counts), batch, links=CATALOGUE.links)


def test_tables_split_by_columns_to_fit_and_repeat_the_labels():
    header = ["name", "n"] + [f"column {i}" for i in range(20)]
    rows = [["a-long-strategy-name", "8"] + [f"{i * 1.5:.2f}" for i in range(20)]]
    assert max(map(len, table(header, rows))) > WIDTH
    lines = fitted_table(header, rows, keep=2)
    assert max(map(len, lines)) <= WIDTH
    headers = [line for line in lines if line.startswith("name")]
    assert len(headers) >= 2 and all(line.split()[:2] == ["name", "n"] for line in headers)
    # every cell is still there, once
    cells = " ".join(lines)
    assert all(cells.count(f"column {i} ") + cells.endswith(f"column {i}") >= 1 for i in range(20))
    assert cells.count("a-long-strategy-name") == len(headers)
    # a table that fits is left whole; names stay left, figures right
    assert fitted_table(["name", "ms"], [["ddp", "1.5"], ["fsdp", "12.25"]]) == [
        "name     ms",
        "ddp     1.5",
        "fsdp  12.25",
    ]


def test_wrapping_keeps_hyphenated_names_whole():
    text = "  - " + "the fastest link for rtx-3090 is nvlink-bridge, " * 6
    lines = wrap(text, subsequent="    ")
    assert max(map(len, lines)) <= WIDTH and all(line.startswith("    ") for line in lines[1:])
    assert sum(line.count("nvlink-bridge") for line in lines) == 6
    long_list = ", ".join(f"gpu-number-{i}" for i in range(30))
    lines = table_wrapping_last(["name", "GB/s", "GPUs"], [["pcie4", "31.5", long_list], ["pcie5", "63", "-"]])
    assert max(map(len, lines)) <= WIDTH and lines[-1].split() == ["pcie5", "63", "-"]
    assert " ".join(lines).count("gpu-number-") == 30


def test_the_printed_plan_fits_100_columns_and_keeps_every_figure():
    plan = resnet_plan()
    text = plan.format_table()
    assert max(map(len, text.splitlines())) <= WIDTH
    for p in plan.predictions:
        row = next(line.split() for line in plan.summary_lines() if line.split()[:2] == [p.strategy, str(p.devices)])
        assert f"{p.samples_per_second:,.0f}" in row and f"{p.speedup:.2f}x" in row
        phases = next(line.split() for line in plan.phase_lines() if line.split()[:2] == [p.strategy, str(p.devices)])
        assert len(phases) == 2 + len([h for h in PHASE_HEADERS if any(h in q.breakdown for q in plan.predictions)])
        assert sum(float(cell) for cell in phases[2:] if cell != "-") == pytest.approx(p.step_seconds * 1e3, rel=0.02)
    # the phase legend spells out each abbreviation it uses
    legend = " ".join(" ".join(plan.phase_lines()).split())
    assert "a-red exposed all-reduce" in legend and "repl parameter broadcast from device 0" in legend


def test_a_global_batch_shows_each_devices_share():
    plan = resnet_plan(["single", "ddp"], counts=(1, 3), batch=BatchSize(100, per_device=False))
    lines = plan.summary_lines()
    assert lines[0].split()[:3] == ["strategy", "devices", "batch/dev"]
    assert [line.split()[2] for line in lines[1:4]] == ["100", "100", "34"]
    assert plan.to_dict()["batch_size"] == 100 and plan.to_dict()["batch_size_per_device"] is None


def test_equal_lines_are_found_and_only_those():
    throughput = {
        "dp": [(1, 100.0), (2, 180.0)],
        "dp-balanced": [(1, 100.0), (2, 180.5)],
        "ddp": [(1, 100.0), (2, 195.0)],
        "fsdp": [(1, 100.0), (2, 195.9)],
        "single": [(1, 100.0)],  # one point: a marker, not a line
    }
    assert equal_lines(throughput) == [["dp", "dp-balanced"], ["ddp", "fsdp"]]
    assert equal_lines({"dp": [(1, 1.0), (2, 2.0)], "ddp": [(1, 1.0), (2, 2.1)]}) == []


def test_each_strategy_has_a_line_of_its_own_in_the_figure(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", lambda figure=None: kept.append(figure))
    # ResNet-50 on NVLinked V100s: dp and dp-balanced predict the same throughput, and so do ddp and fsdp
    plan = resnet_plan()
    assert plan.save_png(tmp_path / "plan.png").stat().st_size > 0
    axes = kept[0].axes[0]
    lines = {line.get_label(): line for line in axes.get_lines()}
    drawn = list(dict.fromkeys(p.strategy for p in plan.predictions))
    assert list(lines) == drawn
    styles = plan.line_styles()
    looks = set()
    for strategy, line in lines.items():
        style = styles[strategy]
        assert line.get_markersize() == pytest.approx(style["markersize"])
        assert line.get_linewidth() == pytest.approx(style["linewidth"])
        dashes = line._unscaled_dash_pattern  # matplotlib reduces a dash tuple's get_linestyle() to "--"
        looks.add((line.get_marker(), str(dashes)))
    assert len(looks) == len(lines)  # no two strategies share a (marker, line style) pair
    # drawn first, drawn largest: an equal line drawn over another leaves it showing around it
    sizes = [lines[strategy].get_markersize() for strategy in drawn]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    title = axes.get_title()
    groups = title.split("equal within 1%: ")[1].split("; ")
    assert "dp = dp-balanced" in groups and any(group.startswith("ddp = fsdp") for group in groups), title


# ---- memory by category: every registered strategy and each variant it plans ------------------------------------


class PlansTwoWays(Strategy):
    """A made-up strategy whose option shards the optimizer state: the plan shows both, knowing neither."""

    name = "two-ways"
    traits = strategy_class("ddp").traits
    options = ("split",)
    planned_variants = ({"split": True},)

    @classmethod
    def traits_for(cls, **options):
        super().traits_for(**options)
        return dataclasses.replace(cls.traits, optimizer_state=SHARDED) if options.get("split") else cls.traits


def test_the_memory_table_shows_every_strategy_and_its_variants_by_category(monkeypatch):
    from dpkit import strategies

    monkeypatch.setitem(strategies.STRATEGIES, PlansTwoWays.name, f"{__name__}:PlansTwoWays")
    profile = builtin_profile("gpt2-1.5b")
    machine = Hardware(CATALOGUE.gpu("a100-40gb-sxm"), CATALOGUE.link("nvlink3"))
    plan = make_plan(profile, machine, available_strategies(), [1, 8], 2, "bf16-mixed")
    expected = [
        (name, options) for name in available_strategies() for options in ({}, *strategy_class(name).planned_variants)
    ]
    assert [(row.strategy, row.options) for row in plan.memory] == expected
    for row in plan.memory:
        devices = 1 if strategy_class(row.strategy).traits.max_devices == 1 else 8
        setup = Setup(profile, machine, row.strategy, devices, 2, "bf16-mixed", options=row.options)
        accounts = memory_by_category(setup)
        assert row.devices == devices and row.bytes_by_category in accounts
        assert row.peak_bytes == max(sum(account.values()) for account in accounts)
    by_label = {row.label: row for row in plan.memory}
    whole, split = by_label["two-ways"], by_label["two-ways split=True"]
    assert split.bytes_by_category["optimizer_state"] * 8 == whole.bytes_by_category["optimizer_state"]
    assert (whole.shards, split.shards) == ("-", "o/8")
    # in the printed plan and its JSON
    lines = plan.memory_lines()
    assert lines[0].startswith("memory per device by category, GiB")
    assert max(map(len, lines)) <= WIDTH
    labels = {" ".join(line.split()[:2]) if "=" in line else line.split()[0] for line in lines[2:] if line.strip()}
    assert set(by_label) <= labels
    assert "memory per device by category" in plan.format_table()
    assert plan.to_dict()["memory_by_category"][-1] == split.to_dict() and split.to_dict()["sharded"] == [
        "optimizer_state"
    ]
