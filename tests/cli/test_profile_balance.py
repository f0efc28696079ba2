"""dp-balanced evens the devices out at `dpkit profile`'s default batch (issue 41), and where a batch is too small
for it (device 0's fixed share is the largest peak whatever the split) the report says so in one line, with the
batch from which it can."""

import itertools
import json

import pytest

from dpkit.cli.main import main
from dpkit.observe.measured_balance import Balancer
from dpkit.observe.report import DeviceReport, Report
from dpkit.parallel.balance import LinearCost, fixed_share_limit, solve
from dpkit.recipe.config import TrainConfig
from dpkit.tools.profile import DEFAULT_BATCH_SIZE, ProfileSpec, global_batch_size

MIB = 2**20
KEYS = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
# wide-output under dp-balanced on 4 virtual CPU devices, batch 64: peak MiB per device in the calibration's
# warm-up, even and halved steps (measured by `dpkit profile --batch-size 64`)
CALIBRATION_64 = [
    ([16, 16, 16, 16], [15.002, 6.274, 6.274, 6.274]),
    ([16, 16, 16, 16], [15.178, 6.274, 6.274, 6.274]),
    ([8, 19, 19, 18], [15.178, 6.883, 6.883, 6.654]),
]


def calibrated(steps):
    balancer = Balancer("memory", KEYS)
    for rows, mib in steps:
        sizes, measure = balancer.plan(sum(rows))
        assert measure and sizes == rows
        balancer.record(rows, [m * MIB for m in mib])
    return balancer


def imbalance(values):
    return max(values) / (sum(values) / len(values))


def test_at_64_rows_device_0s_fixed_share_is_the_largest_peak_of_every_split():
    balancer = calibrated(CALIBRATION_64)
    cost = balancer.cost
    assert cost is not None and cost.per_row[0] == 0.0  # cpu:0's peak did not move with its rows: 8 or 16
    assert balancer.plan(64) == ([16, 16, 16, 16], False)
    # whatever the split, cpu:0's share stays the largest peak: max/mean 1.6 at best (cpu:0 idle)
    best = min(
        imbalance(cost.predict([64 - sum(rest), *rest]))
        for rest in itertools.product(range(65), repeat=3)
        if sum(rest) <= 64
    )
    assert best > 1.5 and max(cost.predict([0, 21, 21, 22])[1:]) < cost.fixed[0]
    limit = fixed_share_limit([16, 16, 16, 16], cost)
    assert limit is not None and limit.device == 0 and limit.fixed == pytest.approx(15.178 * MIB)
    assert 150 < limit.batch_to_reach <= 256  # the default batch on 4 devices is past it
    assert balancer.limit_note(64) == (
        "balance='memory': cpu:0 holds 15.2 MiB whatever its rows (parameters, summed gradients, optimizer state) "
        "and the other devices stay below it with 64 rows, so no split lowers the largest peak and the rows stay "
        f"[16, 16, 16, 16]; from a batch of about {limit.batch_to_reach} ({-(-limit.batch_to_reach // 4)} per device) "
        "the others reach it and the peaks even out"
    )


def test_no_note_where_rows_set_the_largest_peak():
    # the cost measured at batch 256: the split moves rows off cpu:0 and the peaks even out
    cost = LinearCost((8.103 * MIB, 2.53 * MIB, 2.53 * MIB, 2.53 * MIB), (226.4 * 1024, *[234.62 * 1024] * 3))
    rows = solve("memory", 256, cost, [None] * 4)
    assert rows == [49, 69, 69, 69] and imbalance(cost.predict(rows)) < 1.05
    assert fixed_share_limit(rows, cost) is None
    assert Balancer("memory", KEYS).limit_note(64) is None  # nothing measured yet: nothing to say
    assert calibrated(CALIBRATION_64).limit_note(10_000) is None  # a batch past the limit


def test_the_note_is_the_line_under_the_imbalance():
    report = Report([DeviceReport("cpu:0", 16, MIB, {"other": MIB}, {})], steps=1)
    report.meta["balance_note"] = "balance='memory': why"
    lines = report.format_table().splitlines()
    assert lines[2].startswith("imbalance (max/mean") and lines[3] == "balance='memory': why"


def test_the_default_batch_is_64_per_device_for_wide_output_and_trains_otherwise():
    assert ProfileSpec().example == "wide-output" and ProfileSpec().batch_size is None
    assert [global_batch_size(ProfileSpec(), n) for n in (1, 2, 4)] == [64, 128, 256]
    assert global_batch_size(ProfileSpec(example="digits"), 4) == DEFAULT_BATCH_SIZE == TrainConfig.batch_size == 64
    assert global_batch_size(ProfileSpec(model="pkg.mod:build", input_shape=(8,)), 4) == 64
    assert global_batch_size(ProfileSpec(batch_size=64), 4) == 64  # given: as given
    assert global_batch_size(ProfileSpec(example="digits", batch_size_per_device=8), 4) == 32


def profile_json(tmp_path, capsys, *extra):
    out = tmp_path / "balanced.json"
    argv = ["profile", "--example", "wide-output", "--strategy", "dp-balanced", "--accelerator", "cpu"]
    argv += ["--devices", "4", "--steps", "1", "--warmup", "3", "--no-progress", "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


@pytest.mark.slow
def test_dp_balanced_evens_wide_output_out_at_the_default_batch_and_says_why_not_at_64(tmp_path, capsys):
    report, _ = profile_json(tmp_path, capsys)  # no --batch-size
    rows = [d["rows"] for d in report["devices"]]
    assert report["batch_size"] == 256 and sum(rows) == 256 and rows[0] < min(rows[1:])
    assert report["imbalance"] <= 1.10 and "balance_note" not in report

    report, printed = profile_json(tmp_path, capsys, "--batch-size", "64")
    assert [d["rows"] for d in report["devices"]] == [16, 16, 16, 16] and report["imbalance"] > 1.5
    note = report["balance_note"]
    assert note.startswith("balance='memory': cpu:0 holds ") and "no split lowers the largest peak" in note
    assert 150 < int(note.split("from a batch of about ")[1].split()[0]) <= 256
    lines = printed.splitlines()
    assert lines[lines.index(note) - 1].startswith("imbalance (max/mean of per-device peaks): ")
