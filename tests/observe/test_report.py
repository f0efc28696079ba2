"""Phase times per device, the report's numbers and files."""

import json

import torch
import torch.nn.functional as F
from torch import nn

import dpkit
from dpkit.observe import PHASES, Observer
from dpkit.observe.report import DeviceReport, Report


def test_every_phase_of_a_data_parallel_step_is_timed_on_its_device():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = dpkit.DataParallel(model, dpkit.cpu_devices(2), loss_fn=F.cross_entropy)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    with Observer(models=[model], optimizers=[optimizer]) as obs:
        loss = dp(x, target=y)
        with obs.phase("backward"):
            loss.backward()
        optimizer.step()
    report = obs.report()
    primary, other = report.device("cpu:0").seconds_by_phase, report.device("cpu:1").seconds_by_phase
    assert {"scatter", "forward", "loss", "backward", "reduce", "optimizer"} <= set(primary)
    assert {"replicate", "forward", "loss", "backward"} <= set(other)
    assert "optimizer" not in other and "reduce" not in other  # the reduction happens on the primary
    assert all(seconds >= 0 for d in report.devices for seconds in d.seconds_by_phase.values())
    assert list(primary) == [p for p in PHASES if p in primary]  # in pipeline order
    assert [d.rows for d in report.devices] == [3, 3] and report.steps == 1


def test_imbalance_table_json_and_trace(tmp_path):
    categories = {
        "parameters": 60,
        "gradients": 0,
        "optimizer_state": 0,
        "activations": 40,
        "gathered_outputs": 0,
        "loss": 0,
        "other": 0,
    }
    report = Report(
        [
            DeviceReport("cpu:0", 3, 300, dict(categories, other=200), {"forward": 0.5}),
            DeviceReport("cpu:1", 5, 100, categories, {"forward": 0.25}),
        ],
        steps=2,
    )
    assert report.imbalance == 300 / 200
    data = json.loads(report.save_json(tmp_path / "r.json").read_text())
    assert data["imbalance"] == 1.5 and data["devices"][1]["rows"] == 5
    assert data["devices"][0]["seconds_by_phase"] == {"forward": 0.5}
    table = report.format_table()
    assert "cpu:1" in table and "imbalance (max/mean of per-device peaks): 1.500" in table
    assert Report([]).imbalance == 0.0


def test_trace_has_a_track_per_device_with_complete_events(tmp_path):
    with Observer("cpu:0") as obs:
        with obs.phase("gather", "cpu:1"):
            torch.ones(10)
        with obs.phase("optimizer"):
            torch.ones(10)
    events = json.loads(obs.report().save_trace(tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {(e["name"], e["tid"]) for e in spans} == {("gather", names["cpu:1"]), ("optimizer", names["cpu:0"])}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)


def test_reports_of_several_processes_merge_on_one_time_axis():
    from dpkit.observe.timing import Span

    first = Report(
        [DeviceReport("cpu:0", 4, 100, {}, {"all_reduce": 0.5}, {}, {"all_reduce": 0.2})],
        steps=3,
        spans=[Span("cpu:0", "forward", 1.0, 0.5)],
        clock_origin_unix_seconds=1000.0,
    )
    second = Report(
        [DeviceReport("cpu:1", 4, 300, {}, {"all_reduce": 0.4})],
        steps=3,
        spans=[Span("cpu:1", "forward", 1.0, 0.5)],
        clock_origin_unix_seconds=1000.25,
    )
    merged = Report.merged([first, second])
    assert [d.device for d in merged.devices] == ["cpu:0", "cpu:1"] and merged.steps == 3
    assert merged.imbalance == 300 / 200
    assert [(s.device, s.start_seconds) for s in merged.spans] == [("cpu:0", 1.0), ("cpu:1", 1.25)]
    assert merged.to_dict()["devices"][0]["hidden_seconds_by_phase"] == {"all_reduce": 0.2}
    assert "all_reduce hidden ms" in merged.format_table()
