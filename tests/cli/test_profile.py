"""`dpkit profile` through the Engine: faithful dp is lopsided, dp-balanced is even, and replicated and ddp
(every rank's devices in one report) are profiled too."""

import json
import textwrap

import pytest

from dpkit.cli.main import main

SMALL = [
    "--accelerator",
    "cpu",
    "--devices",
    "4",
    "--batch-size",
    "256",
    "--steps",
    "2",
    "--warmup",
    "3",
    "--no-progress",
]


def run_profile(tmp_path, strategy, *extra):
    out = tmp_path / f"{strategy}.json"
    code = main(["profile", "--example", "wide-output", "--strategy", strategy, *SMALL, "--json", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


def test_faithful_dp_shows_device_zero_imbalance_and_dp_balanced_removes_it(tmp_path, capsys):
    dp = run_profile(tmp_path, "dp", "--png", str(tmp_path / "dp.png"), "--trace", str(tmp_path / "dp_trace.json"))
    peaks = [d["peak_bytes"] for d in dp["devices"]]
    assert [d["device"] for d in dp["devices"]] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert peaks[0] >= 1.3 * sum(peaks[1:]) / 3
    assert dp["imbalance"] == pytest.approx(max(peaks) / (sum(peaks) / 4))
    assert [d["rows"] for d in dp["devices"]] == [64, 64, 64, 64]

    balanced = run_profile(tmp_path, "dp-balanced", "--precision", "64")
    assert balanced["imbalance"] <= 1.10
    rows = [d["rows"] for d in balanced["devices"]]
    assert sum(rows) == 256 and rows[0] < min(rows[1:])
    # five Adam steps with the loss inside the replicas, on uneven chunks, track a single device exactly
    single = run_profile(tmp_path, "single", "--precision", "64", "--devices", "1")
    assert balanced["last_loss"] == pytest.approx(single["last_loss"], rel=1e-12)
    assert balanced["last_loss"] == pytest.approx(dp["last_loss"], rel=1e-5)  # dp ran in float32

    for entry in dp["devices"] + balanced["devices"]:
        assert set(entry) >= {"device", "rows", "peak_bytes", "bytes_by_category", "seconds_by_phase"}
        assert sum(entry["bytes_by_category"].values()) == entry["peak_bytes"]
    assert {"forward", "backward", "optimizer"} <= set(dp["devices"][0]["seconds_by_phase"])
    assert "forward" in dp["devices"][3]["seconds_by_phase"]

    assert (tmp_path / "dp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((tmp_path / "dp_trace.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in trace if e.get("name") == "thread_name"}
    assert set(tracks) == {"cpu:0", "cpu:1", "cpu:2", "cpu:3"}
    forward_tracks = {e["tid"] for e in trace if e["ph"] == "X" and e["name"] == "forward"}
    assert forward_tracks == set(tracks.values())
    printed = capsys.readouterr().out
    assert "imbalance (max/mean of per-device peaks)" in printed and "cpu:3" in printed


def test_single_and_a_user_model(tmp_path, monkeypatch):
    package = tmp_path / "mymodels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tiny.py").write_text(
        textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        def data(seed):
            g = torch.Generator().manual_seed(seed)
            return torch.randn(64, 5, generator=g), torch.randint(0, 3, (64,), generator=g)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "single.json"
    code = main(
        [
            "profile",
            "--model",
            "mymodels.tiny:build",
            "--data",
            "mymodels.tiny:data",
            "--strategy",
            "single",
            "--accelerator",
            "cpu",
            "--devices",
            "1",
            "--batch-size",
            "16",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert [d["device"] for d in report["devices"]] == ["cpu:0"] and report["imbalance"] == 1.0
    assert report["devices"][0]["bytes_by_category"]["parameters"] == (5 * 8 + 8 + 8 * 3 + 3) * 4


def test_an_unknown_strategy_is_a_clear_error(capsys):
    assert main(["profile", "--strategy", "nonesuch", "--accelerator", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dpkit profile: error: --strategy: invalid choice: 'nonesuch' (choose from 'single', ") and (
        len(err.strip().splitlines()) == 1
    )


def param_bytes_of_wide_output(dtype_bytes=4):
    from dpkit.examples import get_example

    return sum(p.numel() for p in get_example("wide-output").build_model().parameters()) * dtype_bytes


def test_replicated_reports_every_replica_on_its_own_device(tmp_path):
    report = run_profile(
        tmp_path,
        "replicated",
        "--devices",
        "3",
        "--batch-size",
        "96",
        "--warmup",
        "1",
        "--trace",
        str(tmp_path / "replicated_trace.json"),
    )
    assert [d["device"] for d in report["devices"]] == ["cpu:0", "cpu:1", "cpu:2"]
    for entry in report["devices"]:
        # each replica's own parameters, and its own optimizer's state, on its own device's books
        assert entry["peak_bytes_by_category"]["parameters"] == param_bytes_of_wide_output()
        assert entry["peak_bytes_by_category"]["optimizer_state"] >= 2 * param_bytes_of_wide_output()
        assert "optimizer" in entry["seconds_by_phase"]
        assert sum(entry["bytes_by_category"].values()) == entry["peak_bytes"]
    trace = json.loads((tmp_path / "replicated_trace.json").read_text())["traceEvents"]
    optimizer_tracks = {e["tid"] for e in trace if e["ph"] == "X" and e["name"] == "optimizer"}
    assert len(optimizer_tracks) == 3


PER_DEVICE_SMALL = ["--devices", "2", "--batch-size", "64", "--warmup", "1", "--precision", "64"]


@pytest.fixture(scope="module")
def ddp_profile(tmp_path_factory):
    """One `dpkit profile --strategy ddp` (launched: two processes), with its trace and plot, read by two tests."""
    folder = tmp_path_factory.mktemp("ddp-profile")
    trace, png = str(folder / "ddp_trace.json"), str(folder / "ddp.png")
    return run_profile(folder, "ddp", *PER_DEVICE_SMALL, "--trace", trace, "--png", png), folder


def test_ddp_writes_one_report_with_every_rank_and_its_all_reduce(tmp_path, ddp_profile):
    small = PER_DEVICE_SMALL
    report, folder = ddp_profile
    assert report["processes"] == 2
    assert [d["device"] for d in report["devices"]] == ["cpu:0", "cpu:1"]
    assert [d["rows"] for d in report["devices"]] == [32, 32] and report["steps"] == 2
    for entry in report["devices"]:
        phases = entry["seconds_by_phase"]
        assert {"forward", "loss", "backward", "all_reduce", "optimizer"} <= set(phases)
        assert 0.0 <= entry["hidden_seconds_by_phase"].get("all_reduce", 0.0) <= phases["all_reduce"] + 1e-9
        assert entry["peak_bytes_by_category"]["parameters"] == param_bytes_of_wide_output(8)
    trace = json.loads((folder / "ddp_trace.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in trace if e.get("name") == "thread_name"}
    assert {e["tid"] for e in trace if e["ph"] == "X" and e["name"] == "all_reduce"} == {
        tracks["cpu:0"],
        tracks["cpu:1"],
    }
    assert (folder / "ddp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each rank's gradient buckets' all-reduces on its own track, in the order it issued them, each inside one of
    # that rank's backwards (the record's clock is the phases'), with what identifies it; issued asynchronously,
    # each lasting until ddp's hook learned that it completed
    for device, tid in tracks.items():
        issued = collectives_on(trace, tid)
        assert [e["args"]["sequence"] for e in issued] == sorted(e["args"]["sequence"] for e in issued)
        buckets = [e for e in issued if e["args"]["op"].startswith("all_reduce of gradient bucket")]
        assert buckets and all(e["name"] == "all_reduce" and e["ph"] == "X" and e["args"]["async"] for e in buckets)
        assert all(e["dur"] > 0 for e in buckets)
        assert {e["args"]["step"] for e in buckets} == {2, 3}  # the observed steps, after one warm-up
        assert all(e["args"]["site"].startswith("profile.py:") and e["args"]["bytes"] > 0 for e in buckets)
        backwards = [e for e in trace if e.get("cat") == "phase" and e["name"] == "backward" and e["tid"] == tid]
        for bucket in buckets:
            assert any(b["ts"] - 1e-3 <= bucket["ts"] <= b["ts"] + b["dur"] + 1e-3 for b in backwards), device
        # engine.reduce's all-reduces, timed until they returned, after the optimizer's step
        reduces = [e for e in issued if e["args"]["op"] == "all_reduce"]
        assert reduces and all(e["ph"] == "X" and e["dur"] >= 0 for e in reduces)
        assert report["collectives_per_step"][device]["all_reduce of gradient bucket"] == len(buckets) / 2
    # the global batch's loss after three Adam steps equals one device's, as ddp promises
    single = run_profile(tmp_path, "single", *small, "--devices", "1")
    assert report["last_loss"] == pytest.approx(single["last_loss"], rel=1e-9)


def collectives_on(trace, tid):
    """The collectives on one track of a trace, in time order."""
    return sorted((e for e in trace if e.get("cat") == "collective" and e["tid"] == tid), key=lambda e: e["ts"])


def test_fsdp_books_its_shards_and_says_what_ddp_would_keep(tmp_path, capfd, ddp_profile):
    ddp = ddp_profile[0]
    capfd.readouterr()
    fsdp = run_profile(tmp_path, "fsdp", *PER_DEVICE_SMALL, "--trace", str(tmp_path / "fsdp_trace.json"))
    printed = capfd.readouterr().out  # printed by rank 0, a process of its own
    for entry, whole in zip(fsdp["devices"], ddp["devices"]):
        mine, theirs = entry["peak_bytes_by_category"], whole["peak_bytes_by_category"]
        # each process books its half of the parameters and of Adam's state (dim 0 padded to a multiple of 2)
        for category in ("parameters", "optimizer_state"):
            assert 0.5 * theirs[category] <= mine[category] <= 0.51 * theirs[category], category
        assert mine["gathered_parameters"] > 0 and theirs["gathered_parameters"] == 0
    kept = fsdp["kept_bytes"]
    assert (
        len(kept) == 2
        and kept[0]["unsharded"]["parameters"] == ddp["devices"][0]["peak_bytes_by_category"]["parameters"]
    )
    assert max(sum(rank["held"].values()) for rank in kept) <= 0.51 * sum(kept[0]["unsharded"].values())
    assert "kept between steps (params + grads + optim): at most" in printed
    assert "unsharded" in next(line for line in printed.splitlines() if line.startswith("device"))
    assert fsdp["last_loss"] == pytest.approx(ddp["last_loss"], rel=1e-9)  # the same steps
    # FSDP2's gathers and reduce-scatters on both ranks' tracks, each timed until it returned, inside its phase
    trace = json.loads((tmp_path / "fsdp_trace.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in trace if e.get("name") == "thread_name"}
    assert set(tracks) == {"cpu:0", "cpu:1"}
    for device, tid in tracks.items():
        issued = collectives_on(trace, tid)
        names = {e["name"] for e in issued}
        for phase in ("all_gather", "reduce_scatter"):  # all_gather_single or _into_tensor, as torch calls them
            assert any(name.startswith(phase) for name in names), (device, names)
            spans = [e for e in trace if e.get("cat") == "phase" and e["name"] == phase and e["tid"] == tid]
            for collective in (e for e in issued if e["name"].startswith(phase)):
                assert collective["ph"] == "X" and collective["args"]["step"] in (2, 3)
                assert any(s["ts"] - 1e-3 <= collective["ts"] <= s["ts"] + s["dur"] + 1e-3 for s in spans), device
    assert "collectives issued per step, on each rank:" in printed and "all_gather" in printed
