"""`dpkit plan --calibration doctor.json`: a `dpkit doctor --json` report's measured all-reduce as the link the
plan runs on (NCCL between a node's GPUs, gloo between CPU processes), told apart from a bench JSON."""

import json

import pytest
from machines import synthetic_bench

from dpkit.cli.main import main
from dpkit.plan.catalogue import Catalogue, Link
from dpkit.plan.configuration import Hardware
from dpkit.plan.cost_model import predict
from dpkit.plan.doctor_links import calibration_files, calibration_kind, measured_link
from dpkit.plan.profiles import builtin_profile, given_profile
from dpkit.plan.transfers import ring_all_reduce_seconds

CATALOGUE = Catalogue.load()
SIZES = [4096 * 4**i for i in range(9)]  # 4 KiB to 256 MiB, as dpkit doctor measures them


def doctor_report(latency, bandwidth, processes=8, accelerator="cuda", gpu="h100-sxm", kind=True):
    """A doctor report whose all-reduce times are the ring's under a known latency and bandwidth."""
    link = Link("truth", bandwidth, bandwidth, latency, "test")
    rows = [
        {"collective": "all_reduce", "size_bytes": size, "world_size": processes,
         "seconds": ring_all_reduce_seconds(link, size, processes)}
        for size in SIZES
    ] + [{"collective": "broadcast", "size_bytes": 4096, "world_size": processes, "seconds": 1.0}]  # fmt: skip
    cuda = [{"index": i, "catalogue_gpu": gpu} for i in range(processes)] if accelerator == "cuda" else []
    report = {
        "accelerator": accelerator,
        "backend": "nccl" if accelerator == "cuda" else "gloo",
        "world_size": processes,
        "devices": {"cpu": {"cores": 2}, "cuda": cuda},
        "collectives": rows,
    }
    return {"kind": "dpkit-doctor", **report} if kind else report


def write(tmp_path, name, document):
    path = tmp_path / name
    path.write_text(json.dumps(document))
    return str(path)


def test_the_measured_all_reduce_gives_back_the_links_latency_and_bandwidth():
    link = measured_link(doctor_report(12e-6, 150e9), "doctor.json")
    assert link.achieved_bytes_per_second == pytest.approx(150e9, rel=1e-6)
    assert link.latency_seconds == pytest.approx(12e-6, rel=1e-6)
    assert "doctor.json" in link.source and link.name == "nccl all-reduce measured"
    # one size only: its bandwidth, no latency
    report = doctor_report(0.0, 2e9)
    report["collectives"] = report["collectives"][-2:]
    assert measured_link(report, "one.json").achieved_bytes_per_second == pytest.approx(2e9)
    one_process = {**doctor_report(1e-5, 1e9), "world_size": 1, "collectives": []}
    with pytest.raises(ValueError, match="calibration: 'lone.json' has no all-reduce measured"):
        measured_link(one_process, "lone.json")


def test_bench_and_doctor_files_are_told_apart(tmp_path):
    assert calibration_kind({"kind": "dpkit-bench", "results": []}) == "bench"
    assert calibration_kind(doctor_report(1e-5, 1e9)) == "doctor"
    assert calibration_kind(doctor_report(1e-5, 1e9, kind=False)) == "doctor"  # written before the kind
    assert calibration_kind({"results": []}) is None
    bench = write(tmp_path, "bench.json", {"kind": "dpkit-bench", "results": []})
    doctor = write(tmp_path, "doctor.json", doctor_report(1e-5, 1e9))
    benches, doctors = calibration_files([bench, doctor])
    assert benches == [bench] and list(doctors) == [doctor]
    with pytest.raises(ValueError, match="give one dpkit doctor JSON"):
        calibration_files([doctor, write(tmp_path, "other.json", doctor_report(1e-5, 1e9))])
    with pytest.raises(ValueError, match="is neither a dpkit bench JSON"):
        calibration_files([write(tmp_path, "neither.json", {"results": []})])


def test_a_cuda_doctor_report_replaces_the_link_between_the_gpus(tmp_path, capsys):
    doctor = write(tmp_path, "doctor.json", doctor_report(12e-6, 20e9))  # much slower than nvlink4's 370 GB/s
    out_json = tmp_path / "plan.json"
    args = ["plan", "--model", "gpt2-124m", "--calibration", doctor, "--batch-size-per-device", "8"]
    assert main([*args, "--strategies", "single,ddp", "--device-counts", "8", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "hardware: h100-sxm, link nccl all-reduce measured" in printed  # the GPU the doctor found
    assert "link measured by dpkit doctor" in printed and "in place of nvlink4's 370 GB/s" in printed
    measured = Hardware(CATALOGUE.gpu("h100-sxm"), measured_link(doctor_report(12e-6, 20e9), doctor))
    expected = predict(builtin_profile("gpt2-124m"), measured, "ddp", 8, 8).breakdown["all_reduce"]
    plan = json.loads(out_json.read_text())
    ddp = next(p for p in plan["predictions"] if p["strategy"] == "ddp")
    assert ddp["breakdown"]["all_reduce"] == pytest.approx(expected)
    assert plan["link_measured"] == doctor


def test_a_cpu_doctor_report_replaces_the_link_between_processes_of_a_cpu_bench(tmp_path, capsys):
    profile = given_profile(2e6, 1e6, kernels_per_forward=20)
    bench = write(tmp_path, "bench.json", synthetic_bench(profile, 64))
    doctor_data = doctor_report(3e-5, 0.5e9, processes=2, accelerator="cpu")
    doctor = write(tmp_path, "doctor.json", doctor_data)
    out_json = tmp_path / "plan.json"
    args = ["plan", "--params", "2e6", "--flops-per-sample", "1e6", "--kernels-per-forward", "20"]
    args += ["--calibration", bench, "--calibration", doctor, "--batch-size", "64", "--device-counts", "1,2"]
    assert main([*args, "--strategies", "single,ddp", "--json", str(out_json)]) == 0
    assert "in place of gloo (loopback)'s" in capsys.readouterr().out
    predictions = json.loads(out_json.read_text())["predictions"]
    ddp = next(p for p in predictions if p["strategy"] == "ddp" and p["devices"] == 2)
    link = measured_link(doctor_data, doctor)
    # virtual CPU devices: nothing overlaps, the whole all-reduce (one bucket) shows
    assert ddp["breakdown"]["all_reduce"] == pytest.approx(ring_all_reduce_seconds(link, 8e6, 2))


@pytest.mark.parametrize(
    ("files", "gpu", "words"),
    [
        (["cpu.json"], [], "a dpkit doctor JSON measures the links only"),
        (["cpu.json"], ["--gpu", "h100-sxm"], "measured gloo between CPU processes, which says nothing of h100-sxm"),
        (["unknown-gpu.json"], [], "the GPUs dpkit doctor measured are not in the catalogue"),
        (["neither.json"], [], "is neither a dpkit bench JSON"),
        (["missing.json"], [], "no such file 'missing.json'"),
    ],
)
def test_a_calibration_the_plan_cannot_use_is_one_line(tmp_path, monkeypatch, capsys, files, gpu, words):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "cpu.json", doctor_report(1e-5, 1e9, processes=2, accelerator="cpu"))
    write(tmp_path, "unknown-gpu.json", doctor_report(1e-5, 1e9, gpu=None))
    write(tmp_path, "neither.json", {"results": []})
    args = ["plan", "--params", "1e8", "--batch-size-per-device", "8", *gpu]
    assert main([*args, *(flag for name in files for flag in ("--calibration", name))]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpkit plan: error: --calibration: ") and words in lines[0], lines


def test_dpkit_doctor_json_says_its_kind(tmp_path, monkeypatch, capsys):
    import dpkit.cli.doctor as doctor_cli

    report = doctor_report(1e-5, 1e9, processes=2, accelerator="cpu", kind=False)
    report["devices"]["cpu"].update({"logical_cpus": 2, "torch_threads": 1, "torch_interop_threads": 1})
    report.update({"torch_version": "x", "peer_access": None, "links": {}, "copies": [], "notes": []})
    for row in report["collectives"]:
        row.update({"algbw_bytes_per_second": 1.0, "busbw_bytes_per_second": 1.0, "nominal_bytes_per_second": None,
                    "typical_bytes_per_second": None, "ratio": None, "low": False})  # fmt: skip
    monkeypatch.setattr(doctor_cli, "run_doctor", lambda options: report)
    path = tmp_path / "doctor.json"
    assert main(["doctor", "--accelerator", "cpu", "--no-progress", "--json", str(path)]) == 0
    written = json.loads(path.read_text())
    assert written["kind"] == "dpkit-doctor" and calibration_kind(written) == "doctor"
