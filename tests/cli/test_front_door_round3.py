"""What a torchrun + DDP user tripped on (issue 46): torchrun's spellings at `dpkit launch`, the overview's count of
strategies, and `dpkit profile --strategies` comparing strategies side by side."""

from __future__ import annotations

import json

import pytest

from dpkit.cli.main import main
from dpkit.strategies import available_strategies

CPU2 = ["--accelerator", "cpu", "--devices", "2"]


def test_the_overview_names_every_strategy_train_offers(capsys):
    assert main([]) == 0
    overview = " ".join(capsys.readouterr().out.split())
    assert f"{len(available_strategies())} strategies behind one training loop" in overview
    assert f"({', '.join(available_strategies())})" in overview


# --- torchrun's spellings at `dpkit launch` ---------------------------------------------------------------------
@pytest.fixture
def launches(monkeypatch):
    """What `dpkit launch` passes to the launcher, without starting a process: one dict of arguments per launch."""
    import dpkit.cli.launch

    calls: list[dict] = []
    monkeypatch.setattr(dpkit.cli.launch, "launch", lambda script, args, **kwargs: calls.append(kwargs))
    return calls


def launched_with(launches, argv):
    assert main(["launch", *argv, "train.py", "-t", "3", "--lr=1"]) == 0
    return launches.pop()


@pytest.mark.parametrize(
    ("torchrun", "dpkit"),
    [
        (["--standalone", "--nproc_per_node=2"], ["--nproc-per-node", "2", "--nnodes", "1", "--node-rank", "0"]),
        (
            ["--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29500", "--nproc_per_node=4"],
            ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500"]
            + ["--nproc-per-node", "4"],
        ),
        (  # pytorch/examples' multinode command: an id and c10d at an endpoint, with the node's rank
            ["--nnodes=2:2", "--node_rank=0", "--rdzv_id=456", "--rdzv_backend=c10d"]
            + ["--rdzv_endpoint=10.0.0.1:29603"],
            ["--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port", "29603"],
        ),
        (
            ["--rdzv-endpoint", "node0", "--rdzv-backend", "static"],
            ["--master-addr", "node0", "--master-port", "29400"],
        ),
        (["--max_restarts=3", "--log_dir", "logs"], ["--max-restarts", "3", "--log-dir", "logs"]),
    ],
)
def test_torchruns_spellings_launch_what_dpkits_own_flags_do(launches, torchrun, dpkit):
    given = launched_with(launches, torchrun)
    own = launched_with(launches, dpkit)
    if "--standalone" in torchrun:  # this node alone, whatever a SLURM job around it says
        assert given.pop("slurm") is False and own.pop("slurm") is True
    assert given == own


def test_the_scripts_own_flags_stay_the_scripts_and_the_monitor_interval_reaches_the_launcher(launches, monkeypatch):
    import dpkit.cli.launch

    scripts: list = []
    monkeypatch.setattr(
        dpkit.cli.launch, "launch", lambda script, args, **kwargs: scripts.append((script, args, kwargs))
    )
    assert main(["launch", "--standalone", "--monitor_interval=0.5", "train.py", "-t", "3", "--standalone"]) == 0
    script, args, kwargs = scripts.pop()
    assert (script, args) == ("train.py", ["-t", "3", "--standalone"])
    assert kwargs["monitor_interval_seconds"] == 0.5 and kwargs["nnodes"] == 1


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--tee", "3"], "--tee: torchrun's flag has no meaning at dpkit launch; use --log-dir DIR: every worker's"),
        (["-r", "3"], "-r: torchrun's flag has no meaning at dpkit launch; use --log-dir DIR"),
        (["--no_python"], "--no_python: torchrun's flag has no meaning at dpkit launch; the script is Python"),
        (
            ["--local_ranks_filter=0"],
            "--local_ranks_filter: torchrun's flag has no meaning at dpkit launch; use --show",
        ),
        (["--nproc_per_node", "gpu"], "--nproc_per_node: expected a positive count of processes or auto, got 'gpu'"),
        (["--nnodes", "1:4"], "--nnodes: expected a node count such as 2 (torchrun's 2:2 too; a range of nodes is"),
        (["--rdzv_backend", "etcd"], "--rdzv_backend: expected static or c10d (dpkit's nodes meet at node 0 with"),
        (["--standalone", "--nnodes", "2"], "--standalone: runs this node alone, meeting at a free port on this"),
        (["--rdzv-endpoint", "a:1", "--master-addr", "b"], "--rdzv-endpoint: a:1 says a, but --master-addr says b;"),
        (["--rdzv_endpoint", "a:x"], "--rdzv-endpoint: expected HOST or HOST:PORT, node 0's address, got 'a:x'"),
        (["--rdzv_backend=c10d", "--nnodes=2"], "--rdzv-backend: c10d would hand out node ranks, but dpkit's nodes"),
    ],
)
def test_a_torchrun_flag_without_a_meaning_here_is_one_line_before_anything_starts(launches, capsys, argv, line):
    assert main(["launch", *argv, "train.py"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dpkit launch: error: {line}"), lines
    assert not launches


def test_a_library_error_names_dpkits_spelling_of_the_flag(capsys, tmp_path):
    assert main(["launch", "--nproc_per_node", "999", str(tmp_path / "train.py")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpkit launch: error: --nproc-per-node: ") and "--force" in err, err


# --- dpkit profile --strategies ----------------------------------------------------------------------------------
@pytest.fixture
def kept_figures(monkeypatch):
    """The figures a command draws, kept open for the test to read."""
    import matplotlib.pyplot as plt

    kept: list = []
    monkeypatch.setattr(plt, "close", lambda figure=None: kept.append(figure))
    yield kept
    for figure in kept:
        figure.clf()


def test_profile_runs_each_strategy_in_the_order_given_and_shows_them_side_by_side(tmp_path, capsys, kept_figures):
    out, png, trace = tmp_path / "both.json", tmp_path / "both.png", tmp_path / "trace.json"
    argv = ["profile", "--example", "digits", "--strategies", "replicated,dp", *CPU2, "--steps", "2", "--warmup", "1"]
    assert main([*argv, "--no-progress", "--json", str(out), "--png", str(png), "--trace", str(trace)]) == 0
    printed = capsys.readouterr().out.splitlines()
    data = json.loads(out.read_text())
    assert data["strategies"] == ["replicated", "dp"]
    runs = data["runs"]
    assert [run["strategy"] for run in runs] == ["replicated", "dp"]
    assert all([d["device"] for d in run["devices"]] == ["cpu:0", "cpu:1"] for run in runs)
    assert runs[0]["last_loss"] == pytest.approx(runs[1]["last_loss"], rel=1e-5)  # the same model, batches, steps
    # one table: a row per device, a column pair per strategy, the JSON's numbers
    header = next(i for i, line in enumerate(printed) if line.split()[:1] == ["device"])
    assert printed[header].split() == [
        "device",
        "replicated",
        "peak",
        "MiB",
        "replicated",
        "ms",
        "dp",
        "peak",
        "MiB",
        "dp",
        "ms",
    ]
    for line, device in zip(printed[header + 1 : header + 3], ("cpu:0", "cpu:1")):
        cells = line.split()
        assert cells[0] == device
        for run, peak in zip(runs, (cells[1], cells[3])):
            measured = next(d for d in run["devices"] if d["device"] == device)["peak_bytes"]
            assert float(peak) == pytest.approx(measured / 2**20, abs=0.006)
    imbalance = printed[header + 3].split()
    assert imbalance[0] == "imbalance" and [float(x) for x in imbalance[1:]] == pytest.approx(
        [run["imbalance"] for run in runs], abs=0.006
    )
    assert printed[header + 4].split()[0] == "step" and len(printed[header + 4].split()) == 3
    assert f"last loss: replicated {runs[0]['last_loss']:.6f}, dp {runs[1]['last_loss']:.6f}" in printed
    # the figure: a column per strategy, memory above and time below, each device a bar
    figure = kept_figures[-1]
    top = [axes for axes in figure.axes if axes.get_subplotspec().rowspan.start == 0]
    assert [axes.get_title().splitlines()[0] for axes in top] == ["replicated", "dp"]
    assert all({tick.get_text() for tick in axes.get_xticklabels()} == {"cpu:0", "cpu:1"} for axes in figure.axes)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for strategy in ("replicated", "dp"):  # a trace per strategy, each with both devices' tracks
        events = json.loads((tmp_path / f"trace-{strategy}.json").read_text())["traceEvents"]
        assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} == {"cpu:0", "cpu:1"}


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--strategies", "dp,nonesuch"], "--strategies: expected strategies from single, dp,"),
        (["--strategy", "ddp", "--strategies", "dp,ddp"], "--strategies: not allowed with argument --strategy"),
        (["--strategies", "dp,dp"], "--strategies: dp given twice; name each strategy once"),
        (["--strategies", "dp,single", "--devices", "2"], "--devices: strategy 'single' runs on 1 device(s), got 2"),
    ],
)
def test_a_bad_list_of_strategies_is_one_line_before_any_runs(capsys, argv, line):
    assert main(["profile", "--example", "digits", "--accelerator", "cpu", *argv, "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dpkit profile: error: {line}"), lines


def test_a_device_one_strategy_has_not_is_a_dash_in_its_columns():
    from dpkit.observe.report import DeviceReport, Report
    from dpkit.observe.side_by_side import side_by_side_table

    one = Report([DeviceReport("cpu:0", 8, 2**20, {}, {"forward": 0.002})], steps=2)
    two = Report([DeviceReport(f"cpu:{i}", 4, (2 - i) * 2**20, {}, {"forward": 0.004}) for i in (0, 1)], steps=2)
    two.threads = {"step_seconds": 0.003, "steps": 2}
    rows = [line.split() for line in side_by_side_table([one, two], ["single", "dp"]).splitlines()[:5]]
    assert rows[1:] == [
        ["cpu:0", "1.00", "1.00", "2.00", "2.00"],
        ["cpu:1", "-", "-", "1.00", "2.00"],
        ["imbalance", "1.00", "1.33"],
        ["step", "-", "3.00"],
    ]


def test_the_demo_on_one_device_says_where_to_see_dp_against_ddp(tmp_path, capsys):
    argv = ["demo", "--accelerator", "cpu", "--devices", "1", "--epochs", "1", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "the lesson's end, dp against ddp, needs two devices or more: `dpkit demo --accelerator cpu`" in out
