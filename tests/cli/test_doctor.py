import argparse
import json

import pytest
import torch

from dpkit.cli.doctor import format_report, parse_bytes
from dpkit.cli.main import main
from dpkit.plan.catalogue import Catalogue
from dpkit.tools.doctor.bandwidth import algorithm_bandwidth, bus_bandwidth, bus_bandwidth_factor, message_sizes
from dpkit.tools.doctor.checkup import DoctorOptions, run_doctor
from dpkit.tools.doctor.collectives import collective_rows
from dpkit.tools.doctor.comparison import Comparison
from dpkit.tools.doctor.copies import measure_cpu_copy


@pytest.mark.parametrize("world_size, factor", [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75)])
def test_all_reduce_bus_factor_is_two_n_minus_one_over_n(world_size, factor):
    assert bus_bandwidth_factor("all_reduce", world_size) == pytest.approx(factor)
    assert bus_bandwidth("all_reduce", 2**20, 1e-3, world_size) == pytest.approx(2**20 / 1e-3 * factor)


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_broadcast_bus_bandwidth_is_algorithm_bandwidth(world_size):
    assert (
        bus_bandwidth("broadcast", 4096, 2e-6, world_size) == algorithm_bandwidth(4096, 2e-6) == pytest.approx(2.048e9)
    )


def test_bandwidth_arguments_checked():
    with pytest.raises(ValueError, match="collective: unknown collective 'alltoall'"):
        bus_bandwidth_factor("alltoall", 4)
    with pytest.raises(ValueError, match="seconds"):
        algorithm_bandwidth(10, 0.0)
    with pytest.raises(ValueError, match="world_size"):
        bus_bandwidth_factor("all_reduce", 0)


def test_message_sizes():
    assert message_sizes(4096, 2**20, 4) == [4096, 16384, 65536, 262144, 1048576]
    assert message_sizes(4096, 10000, 2) == [4096, 8192, 10000]
    with pytest.raises(ValueError, match="min_bytes <= max_bytes"):
        message_sizes(2**20, 4096)


def test_parse_bytes():
    assert [parse_bytes(text) for text in ("4096", "4K", "4KiB", "64M", "1g")] == [4096, 4096, 4096, 64 * 2**20, 2**30]
    with pytest.raises(argparse.ArgumentTypeError, match="4K"):
        parse_bytes("4 parsecs")


def test_collective_rows_ratio_and_low_flag_only_at_the_largest_size():
    timings = [
        {"collective": "all_reduce", "size_bytes": 4096, "seconds": 1e-3},
        {"collective": "all_reduce", "size_bytes": 2**20, "seconds": 1e-3},
    ]
    pcie4 = Catalogue.load().link("pcie4")
    rows = collective_rows(
        timings, 4, Comparison(pcie4.name, pcie4.nominal_bytes_per_second, pcie4.achieved_bytes_per_second)
    )
    for row in rows:
        assert row["busbw_bytes_per_second"] == pytest.approx(row["size_bytes"] / 1e-3 * 1.5)
        assert row["ratio"] == pytest.approx(row["busbw_bytes_per_second"] / 31.5e9)
        assert row["compared_with"] == "pcie4"
    assert [row["low"] for row in rows] == [False, True]  # 1.5 GB/s is far below pcie4's typical 25 GB/s
    nothing = collective_rows(timings, 2, Comparison())
    assert all(row["ratio"] is None and row["nominal_bytes_per_second"] is None and not row["low"] for row in nothing)


def test_cpu_memory_copy_measured():
    (row,) = measure_cpu_copy(2**20, 2)
    assert row["kind"] == "memory_copy" and row["size_bytes"] == 2**20
    assert row["bytes_per_second"] == pytest.approx(row["size_bytes"] / row["seconds"])
    assert row["ratio"] is None and "no catalogue figure" in row["note"]


def test_doctor_json_on_cpu_holds_measured_collectives(tmp_path, capsys):
    path = tmp_path / "doctor.json"
    code = main(
        [
            "doctor",
            "--accelerator",
            "cpu",
            "--max-bytes",
            "64K",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--copy-bytes",
            "1M",
            "--link",
            "pcie4",
            "--no-progress",
            "--json",
            str(path),
        ]
    )
    assert code == 0
    report = json.loads(path.read_text())
    assert report["backend"] == "gloo" and report["world_size"] == 2
    assert report["devices"]["cpu"]["cores"] >= 1 and report["devices"]["cuda"] == []
    all_reduce = [row for row in report["collectives"] if row["collective"] == "all_reduce"]
    assert [row["size_bytes"] for row in all_reduce] == [4096, 16384, 65536]
    for row in report["collectives"]:
        assert row["seconds"] > 0
        factor = 1.0 if row["collective"] == "broadcast" else 2 * (2 - 1) / 2
        assert row["algbw_bytes_per_second"] == pytest.approx(row["size_bytes"] / row["seconds"])
        assert row["busbw_bytes_per_second"] == pytest.approx(row["algbw_bytes_per_second"] * factor)
        assert row["nominal_bytes_per_second"] == 31.5e9
        assert row["ratio"] == pytest.approx(row["busbw_bytes_per_second"] / 31.5e9)
    assert {row["collective"] for row in report["collectives"]} == {"all_reduce", "broadcast"}
    assert report["copies"][0]["kind"] == "memory_copy"
    best = report["summary"]["all_reduce"]
    assert best["busbw_bytes_per_second"] == max(row["busbw_bytes_per_second"] for row in all_reduce)
    assert best["ratio"] == pytest.approx(best["busbw_bytes_per_second"] / 31.5e9)
    printed = capsys.readouterr().out
    assert "all_reduce" in printed and "busbw GB/s" in printed and "64 KiB" in printed


def test_format_report_without_link_says_nothing_applies():
    report = {
        "accelerator": "cpu",
        "backend": "gloo",
        "world_size": 2,
        "torch_version": torch.__version__,
        "devices": {"cpu": {"cores": 2, "logical_cpus": 2, "torch_threads": 2, "torch_interop_threads": 2}, "cuda": []},
        "peer_access": None,
        "copies": measure_cpu_copy(2**16, 1),
        "collectives": collective_rows(
            [{"collective": "broadcast", "size_bytes": 4096, "seconds": 1e-4}], 2, Comparison()
        ),
        "notes": ["CPU only: no catalogue link applies"],
    }
    text = format_report(report)
    assert "nothing" in text and "note: CPU only" in text and "broadcast" in text


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--link", "nvlink9"], "--link: link: unknown link 'nvlink9'"),
        (["--collectives", "all_reduce,gossip"], "--collectives"),
        (["--iters", "0"], "--iters: expected an integer >= 1, got 0"),
    ],
)
def test_bad_arguments_are_one_line(capsys, argv, expected):
    assert main(["doctor", "--accelerator", "cpu", "--no-progress", *argv]) == 2
    error = capsys.readouterr().err.strip()
    assert expected in error and "\n" not in error


def test_cuda_asked_without_gpu_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        run_doctor(DoctorOptions(accelerator="cuda"))


@pytest.mark.cuda
def test_doctor_on_gpus():
    report = run_doctor(
        DoctorOptions(
            accelerator="cuda", max_bytes=2**20, iterations=3, copy_bytes=2**24, copy_repeats=2, progress=False
        )
    )
    count = torch.cuda.device_count()
    assert report["backend"] == "nccl" and len(report["devices"]["cuda"]) == count
    kinds = [(row["kind"], row["memory"]) for row in report["copies"]]
    for kind in ("host_to_device", "device_to_host"):
        assert kinds.count((kind, "pinned")) == count and kinds.count((kind, "pageable")) == count
    assert kinds.count(("device_to_device", None)) == count + count * (count - 1)
    assert all(row["bytes_per_second"] > 0 for row in report["copies"])
    assert len(report["peer_access"]) == count
    if count >= 2:
        assert {row["size_bytes"] for row in report["collectives"]} == set(report["sizes_bytes"])


def test_failed_worker_is_one_runtime_error_line(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("needs a machine where NCCL workers fail: no GPU")
    import tempfile

    from dpkit.tools.doctor.collectives import measure_collectives

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where torch's spawn puts its workers' error files
    with pytest.raises(RuntimeError) as info:  # one worker is enough to fail: each fails alike, in set_device
        measure_collectives(
            "nccl", 1, [4096], ["all_reduce"], iterations=1, warmup=0, show_progress=False, timeout_seconds=30
        )
    message = str(info.value)
    assert message.startswith("doctor: a nccl worker failed") and "\n" not in message
    assert not list(tmp_path.iterdir())  # the failed workers' error files are removed, and doctor's own folder
