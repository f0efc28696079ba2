"""`dpkit bench`: strategies side by side on 1 and 2 virtual CPU devices in one command."""

import json

from dpkit.cli.main import main
from dpkit.tools.bench.results import ConfigResult, lost_by_phase

# One strategy of each way bench runs one (one device, per-step replicas, balanced, persistent replicas, a process
# per device, launched): fsdp, zero and hsdp run through bench exactly as ddp does (bench asks only whether a
# strategy has a process per device), so benching them too would add two launches each (~10 s) and no bench code.
# Every registered strategy is bench's default (checked below).
KINDS = ["single", "dp", "dp-balanced", "replicated", "ddp"]


def test_bench_defaults_to_every_registered_strategy():
    from dpkit.cli.main import build_parser
    from dpkit.strategies import available_strategies

    args = build_parser().parse_args(["bench"])
    assert args.strategies == available_strategies()


def test_bench_runs_each_kind_of_strategy_at_every_device_count(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(
        [
            "bench",
            "--strategies",
            ",".join(KINDS),
            "--example",
            "digits",
            "--device-counts",
            "1,2",
            "--batch-size-per-device",
            "16",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--observed-steps",
            "1",
            "--no-progress",
            "--json",
            str(out),
            "--png",
            str(png),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    configurations = [(r["strategy"], r["devices"]) for r in data["results"]]
    assert configurations[0] == ("single", 1)
    for strategy in KINDS[1:]:
        assert [n for s, n in configurations if s == strategy] == [1, 2]
    for r in data["results"]:
        assert len(r["step_seconds_samples"]) == 2 and r["step_seconds"] > 0
        assert r["samples_per_second"] == r["devices"] * 16 / r["step_seconds"]
        assert abs(r["efficiency"] - r["speedup"] / r["devices"]) < 1e-9
        assert r["summary"].startswith(f"{r['devices']} device")
    dp2 = next(r for r in data["results"] if r["strategy"] == "dp" and r["devices"] == 2)
    assert {"scatter", "replicate", "gather"} <= set(dp2["phase_seconds"])
    ddp2 = next(r for r in data["results"] if r["strategy"] == "ddp" and r["devices"] == 2)
    # measured inside the launched workers, which run on their own (not interleaved with the others)
    assert {"forward", "backward", "optimizer"} <= set(ddp2["phase_seconds"]) and not ddp2["interleaved"]
    assert data["model"]["parameters"] > 0 and data["machine"]["reference_seconds"] > 0
    assert png.stat().st_size > 0
    table = capsys.readouterr().out
    assert "where it went" in table and "ddp" in table and "replicated" in table


def test_lost_efficiency_is_split_among_the_phases_that_grew():
    baseline = ConfigResult("single", 1, 0.010, [0.010], {"forward": 0.004, "backward": 0.005})
    two = ConfigResult(
        "dp", 2, 0.020, [0.020], {"forward": 0.004, "backward": 0.005, "replicate": 0.003, "gather": 0.001}
    )
    two.speedup, two.efficiency = 1.0, 0.5
    lost = lost_by_phase(two, baseline)
    assert abs(sum(lost.values()) - 0.5) < 1e-9  # half the step is lost against one device
    assert lost["replicate"] > lost["gather"] > 0 and "forward" not in lost
    two.lost = lost
    assert two.summary().startswith("2 devices: 1.00x (50%); lost to replicate")


def test_bad_arguments_get_one_line(capsys):
    assert main(["bench", "--strategies", "single,zero3"]) == 2
    assert "--strategies" in capsys.readouterr().err
    assert main(["bench", "--device-counts", "1,x"]) == 2
    assert "--device-counts: expected device counts such as 1,2,4, got '1,x'" in capsys.readouterr().err
    assert main(["bench", "--batch-size", "32", "--device-counts", "1,3"]) == 2
    assert "--batch-size: 32 does not split evenly over 3 devices" in capsys.readouterr().err
    assert main(["bench", "--batch-size", "32", "--batch-size-per-device", "8"]) == 2
    assert "--batch-size-per-device: not allowed with argument --batch-size" in capsys.readouterr().err
    assert main(["bench", "--model", "widths:narrow"]) == 2
    assert "--input-shape" in capsys.readouterr().err


def test_a_global_batch_stays_the_same_for_every_device_count(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["bench", "--example", "digits", "--strategies", "single,dp", "--device-counts", "1,2"]
    argv += ["--batch-size", "32", "--steps", "2", "--warmup", "1", "--observed-steps", "0", "--no-progress"]
    assert main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["batch_size"] == 32 and data["batch_size_per_device"] is None
    for r in data["results"]:
        assert r["samples_per_second"] == 32 / r["step_seconds"]  # 32 rows a step, whatever the count
    assert {(r["strategy"], r["devices"]) for r in data["results"]} == {("single", 1), ("dp", 1), ("dp", 2)}
