"""The collective record's times and the trace's collective events: each entry is issued at a time on the phase
clock and timed until its call returned (asynchronous ones are marked), a profile keeps every entry of its
window, and a report puts each rank's collectives on its device's track, on the merged time axis."""

from __future__ import annotations

import json
import threading
import time

from pytest import approx

from dpkit.observe.collectives import RING_SIZE, CollectiveRecord, call_site
from dpkit.observe.report import CollectiveSpan, DeviceReport, Report, collective_spans
from dpkit.observe.timing import Span


def test_an_entry_is_issued_on_the_phase_clock_and_timed_until_its_call_returned():
    record = CollectiveRecord()
    before = time.perf_counter()
    with record.issuing("all_reduce", 16) as entry:
        assert entry is not None and entry.seconds is None  # not returned yet
        time.sleep(0.01)
    assert before <= entry.issued <= before + 0.005
    assert 0.01 <= entry.seconds < 1.0 and not entry.async_op


def test_an_asynchronous_collective_inside_a_recorded_one_marks_it():
    record = CollectiveRecord()
    # ddp's comm hook, and inside it the wrapped dist.all_reduce(..., async_op=True)
    with record.issuing("all_reduce of gradient bucket 0", 8) as outer, record.issuing("all_reduce") as inner:
        assert inner is None
        record.issued_async()
    assert outer is not None and outer.async_op
    record.issued_async()  # outside any: nothing to mark
    with record.issuing("barrier") as barrier:
        pass
    assert barrier is not None and not barrier.async_op


def test_a_profile_window_keeps_every_entry_and_the_ring_its_capacity_after():
    record = CollectiveRecord()
    for _ in range(10):
        record.add("barrier")
    with record.keeping(1000) as before:
        for _ in range(3 * RING_SIZE):
            record.add("all_reduce")
        window = record.since(before)
    assert before == 10 and [e.sequence for e in window] == list(range(11, 11 + 3 * RING_SIZE))
    assert record.entries.maxlen == RING_SIZE and record.last().sequence == 10 + 3 * RING_SIZE
    assert len(record.entries) == RING_SIZE


def test_a_dpkit_command_s_own_line_is_the_site_where_no_user_frame_is_on_the_stack():
    from dpkit.observe import collectives

    dpkit_dir = collectives._DPKIT_DIR
    namespace: dict = {"call_site": call_site}
    # a strategy's collective, called from a command's step (dpkit profile), in a thread: no frame of this file
    exec(
        compile("def issue():\n    return call_site()\n", dpkit_dir + "strategies/fake_strategy.py", "exec"), namespace
    )
    command = "\n\ndef step():\n    return issue()\n\n\ndef run(sites):\n    sites.append(step())\n"
    exec(compile(command, dpkit_dir + "tools/fake_command.py", "exec"), namespace)
    sites: list[str] = []
    thread = threading.Thread(target=namespace["run"], args=(sites,))
    thread.start()
    thread.join()
    assert sites == ["fake_command.py:4 in step"]


def _rank(device: str, origin_unix: float, collectives: list[CollectiveSpan]) -> Report:
    return Report(
        [DeviceReport(device, 4, 100, {}, {"backward": 0.5})],
        steps=2,
        spans=[Span(device, "backward", 1.0, 0.5)],
        clock_origin_unix_seconds=origin_unix,
        collectives=collectives,
    )


def test_each_rank_s_collectives_are_on_its_track_on_the_merged_time_axis(tmp_path):
    record = CollectiveRecord()
    origin = time.perf_counter()
    with record.issuing("all_reduce of gradient bucket 0", 4096) as bucket, record.issuing("all_reduce"):
        record.issued_async()
    with record.issuing("all_gather_single", 512):
        pass
    entries = list(record.entries)
    spans = collective_spans(entries, "cpu:1", origin)
    assert [s.start_seconds for s in spans] == [e.issued - origin for e in entries]
    assert spans[0].seconds is None and spans[1].seconds == entries[1].seconds  # asynchronous: issued only
    assert spans[0].async_op and not spans[1].async_op
    bucket.completed = bucket.issued + 0.25  # as ddp's hook sets it when the bucket's all-reduce completed
    assert collective_spans([bucket], "cpu:1", origin)[0].seconds == approx(0.25)
    assert bucket is not None and spans[0].name == "all_reduce" and spans[0].kind == "all_reduce of gradient bucket"

    first = _rank(
        "cpu:0", 1000.0, [CollectiveSpan("cpu:0", "barrier (engine.close)", 1.2, 0.1, 5, 0, 2, "t.py:3 in f")]
    )
    second = _rank("cpu:1", 1000.25, [CollectiveSpan("cpu:1", "all_gather_single", 1.1, 0.2, 6, 512, 2, "t.py:4 in f")])
    merged = Report.merged([first, second])
    assert [(c.device, c.start_seconds) for c in merged.collectives] == [
        ("cpu:0", approx(1.2)),
        ("cpu:1", approx(1.35)),
    ]

    events = json.loads(merged.save_trace(tmp_path / "t.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    issued = [e for e in events if e.get("cat") == "collective"]
    assert [(e["name"], e["tid"], e["ph"], e["ts"], e["dur"]) for e in issued] == [
        ("barrier", tracks["cpu:0"], "X", approx(1.2e6), approx(1e5)),
        ("all_gather_single", tracks["cpu:1"], "X", approx(1.35e6), approx(2e5)),
    ]
    assert issued[1]["args"] == {
        "op": "all_gather_single",
        "sequence": 6,
        "bytes": 512,
        "step": 2,
        "site": "t.py:4 in f",
    }
    assert issued[0]["args"]["op"] == "barrier (engine.close)"
    phases = [e for e in events if e.get("cat") == "phase"]
    assert [(e["name"], e["tid"]) for e in phases] == [("backward", tracks["cpu:0"]), ("backward", tracks["cpu:1"])]

    # an asynchronous one lasts until it completed, or is an instant event at its issue when that is not known
    merged.collectives.append(CollectiveSpan("cpu:0", "all_reduce of gradient bucket 1", 1.3, 0.5, 7, 8, 2, "?", True))
    merged.collectives.append(CollectiveSpan("cpu:0", "all_reduce of gradient bucket 2", 1.4, None, 8, 8, 2, "?", True))
    timed, instant = [e for e in merged.trace_events() if e.get("cat") == "collective"][-2:]
    assert timed["ph"] == "X" and timed["dur"] == approx(5e5) and timed["args"]["async"]
    assert instant["ph"] == "i" and instant["s"] == "t" and "dur" not in instant and instant["args"]["async"]


def test_the_table_says_how_many_collectives_each_rank_issued_per_step():
    def issued(device: str, ops: list[str]) -> list[CollectiveSpan]:
        return [CollectiveSpan(device, op, 0.0, 0.0, i, 0, 1, "?") for i, op in enumerate(ops)]

    step = ["all_reduce of gradient bucket 0", "all_reduce of gradient bucket 1", "all_reduce"]
    even = _rank("cpu:0", 0.0, issued("cpu:0", step * 2))
    even.collectives += issued("cpu:1", step * 2)
    even.devices.append(DeviceReport("cpu:1", 4, 100, {}, {}))
    assert even.collectives_per_step()["cpu:1"] == {"all_reduce of gradient bucket": 2.0, "all_reduce": 1.0}
    assert even.format_table().splitlines()[-1] == (
        "collectives issued per step, on each rank: 3 (2 all_reduce of gradient bucket, 1 all_reduce)"
    )
    assert even.to_dict()["collectives_per_step"]["cpu:0"]["all_reduce"] == 1.0
    uneven = _rank("cpu:0", 0.0, issued("cpu:0", step * 2) + issued("cpu:1", step * 2 + ["barrier"]))
    assert uneven.collectives_line() == (
        "collectives issued per step: cpu:0 3 (2 all_reduce of gradient bucket, 1 all_reduce); "
        "cpu:1 3.5 (2 all_reduce of gradient bucket, 1 all_reduce, 0.5 barrier)"
    )
    assert Report([]).collectives_line() is None and "collectives_per_step" not in Report([]).to_dict()
