"""The phase chart of `dpkit plan` and `dpkit bench`: a label per configuration that overlaps no other, and the
configurations that do not fit drawn apart, with a legend that says so."""

from itertools import combinations

import pytest

from dpkit.observe.plots import UNFIT_STYLE, PhaseBar, bar_positions
from dpkit.plan.catalogue import Catalogue
from dpkit.plan.planner import make_plan
from dpkit.plan.profiles import builtin_profile
from dpkit.strategies import available_strategies

CATALOGUE = Catalogue.load()


@pytest.fixture
def kept_figures(monkeypatch):
    """The figures a save_png draws, kept open for the test to read."""
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", lambda figure=None: kept.append(figure))
    yield kept
    for figure in kept:
        figure.clf()


def llama_plan(counts):
    """LLaMA-7B on 80 GB A100s: only what shards the weights fits, so the chart has both kinds of bars."""
    from dpkit.plan.configuration import Hardware

    machine = Hardware(CATALOGUE.gpu("a100-80gb-sxm"), CATALOGUE.link("nvlink3"))
    profile = builtin_profile("llama-7b")
    return make_plan(profile, machine, available_strategies(), counts, 1, precision="bf16-mixed", links=CATALOGUE.links)


def test_every_configuration_has_a_label_of_its_own_that_overlaps_no_other(tmp_path, kept_figures):
    plan = llama_plan([1, 2, 4, 8])
    plan.save_png(tmp_path / "plan.png")
    chart = kept_figures[0].axes[1]
    kept_figures[0].canvas.draw()
    labels = [label for label in chart.get_yticklabels() if label.get_text()]
    assert [label.get_text().split(" (")[0] for label in labels] == [
        f"{p.strategy} x{p.total_devices}" for p in plan.predictions
    ]
    renderer = kept_figures[0].canvas.get_renderer()
    boxes = [label.get_window_extent(renderer) for label in labels]
    assert len(boxes) > 20
    assert not [(a, b) for a, b in combinations(range(len(boxes)), 2) if boxes[a].overlaps(boxes[b])]


def test_what_does_not_fit_is_pale_and_hatched_and_the_legend_says_so(tmp_path, kept_figures):
    plan = llama_plan([8])
    plan.save_png(tmp_path / "plan.png")
    chart = kept_figures[0].axes[1]
    unfit = {p.strategy for p in plan.predictions if not p.fits}
    assert unfit and unfit != {p.strategy for p in plan.predictions}
    labels = {label.get_text() for label in chart.get_yticklabels()}
    for p in plan.predictions:
        assert (f"{p.strategy} x8 (does not fit in memory)" in labels) == (not p.fits), p.strategy
    hatched = {
        (round(b.get_y() + b.get_height() / 2, 3)) for b in chart.patches if b.get_hatch() == UNFIT_STYLE["hatch"]
    }
    plain = {(round(b.get_y() + b.get_height() / 2, 3)) for b in chart.patches if not b.get_hatch()}
    positions = dict(zip([p.strategy for p in plan.predictions], bar_positions(bars_of(plan))))
    assert hatched == {positions[s] for s in unfit}
    assert plain == {positions[p.strategy] for p in plan.predictions if p.fits}
    assert all(b.get_alpha() == UNFIT_STYLE["alpha"] for b in chart.patches if b.get_hatch())
    legend = [text.get_text() for text in chart.get_legend().get_texts()]
    assert legend[-1] == "hatched: does not fit in memory" and "forward" in legend


def bars_of(plan):
    return [PhaseBar(p.strategy, p.total_devices, p.breakdown, p.fits, p.runs) for p in plan.predictions]


def test_configurations_of_one_strategy_sit_together_with_a_gap_between_strategies():
    bars = [PhaseBar("dp", 1, {}), PhaseBar("dp", 2, {}), PhaseBar("ddp", 1, {}), PhaseBar("ddp", 2, {}, fits=False)]
    assert bar_positions(bars) == [0.0, 1.0, 2.5, 3.5]
    assert [bar.label for bar in bars][-1] == "ddp x2 (does not fit in memory)"
    assert PhaseBar("dp", 2, {}, runs=False).label == "dp x2 (cannot run)"
