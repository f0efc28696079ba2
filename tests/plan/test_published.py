"""The planner beside published multi-GPU measurements: it gets every direction right.

The figures live in dpkit/plan/published_runs.json; docs/cost-model.md shows the same table."""

from pathlib import Path

from dpkit.plan.published import compare_all, markdown_table


def test_at_least_six_published_runs_of_dp_and_ddp():
    comparisons = compare_all()
    assert len(comparisons) >= 6
    assert {"dp", "ddp"} <= {c.run["strategy"] for c in comparisons}


def test_adding_devices_helps_where_it_was_measured_to_help():
    for c in compare_all():
        if c.quantity == "speedup":
            assert (c.predicted > 1) == (c.measured > 1), c.run["id"]
            assert c.helps


def test_the_faster_strategy_or_link_is_predicted_faster():
    comparisons = {c.run["id"]: c for c in compare_all()}
    pairs = [(faster, slower) for faster, c in comparisons.items() for slower in c.run.get("faster_than", [])]
    assert pairs
    for faster, slower in pairs:
        assert comparisons[faster].measured < comparisons[slower].measured  # the data say so
        assert comparisons[faster].predicted < comparisons[slower].predicted, f"{faster} vs {slower}"


def test_the_docs_table_is_the_one_computed_here():
    doc = (Path(__file__).parents[2] / "docs" / "cost-model.md").read_text()
    assert markdown_table(compare_all()) in doc
