"""`dpkit catalogue`: the GPUs, links and networks, with their figures, in 100 columns; a user file merged in."""

import json

import pytest

from dpkit.cli.main import main
from dpkit.plan.catalogue import Catalogue

CATALOGUE = Catalogue.load()


def listing(capsys, *args):
    assert main(["catalogue", *args]) == 0
    return capsys.readouterr().out.splitlines()


def rows(lines, first_cell):
    return [line.split() for line in lines if line.split()[:1] == [first_cell]]


def test_all_three_sections_fit_100_columns_with_every_entry(capsys):
    lines = listing(capsys)
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    for section in (CATALOGUE.gpus, CATALOGUE.links, CATALOGUE.networks):
        for name in section:
            assert len(rows(lines, name)) == 1, name


def test_gpus_show_memory_tflops_and_links_usual_first(capsys):
    lines = listing(capsys, "gpus")
    assert not rows(lines, "nvlink4") and not rows(lines, "ib-200g")  # one section only
    h100 = rows(lines, "h100-sxm")[0]
    assert h100 == ["h100-sxm", "nvlink4", "pcie5", "80", "3.35", "67.0", "494.5", "989.5", "989.5"]
    rtx = rows(lines, "rtx-3090")[0]
    assert rtx[1:3] == ["pcie4,", "nvlink-bridge"]  # its usual link first
    assert any("Host time per kernel launch: 6 µs (the catalogue" in line for line in lines)


def test_links_show_bandwidth_and_which_gpus_have_them(capsys):
    lines = listing(capsys, "links")
    nvlink4 = rows(lines, "nvlink4")[0]
    assert nvlink4 == ["nvlink4", "450", "370", "3", "8", "h100-sxm,", "h200-sxm"]
    assert rows(lines, "nvlink-bridge")[0][-1] == "(rtx-3090)"  # a link it can have, not its usual one
    pcie4 = " ".join(line for line in lines[lines.index(next(ln for ln in lines if ln.startswith("pcie4"))) :][:3])
    assert all(name in pcie4 for name in CATALOGUE.gpus_with_link("pcie4"))


def test_networks(capsys):
    lines = listing(capsys, "networks")
    assert rows(lines, "eth-10g")[0] == ["eth-10g", "1.25", "1.1", "30"]
    assert len([line for line in lines if line.split()[:1] and line.split()[0] in CATALOGUE.networks]) == 6


def test_a_user_file_is_merged_in_and_json_written(tmp_path, capsys):
    mine = tmp_path / "mine.json"
    mine.write_text(
        json.dumps(
            {
                "gpus": {
                    "lab-gpu": {
                        "peak_flops": {"32": 1e13, "tf32": 1e13, "bf16-mixed": 4e13, "16-mixed": 4e13},
                        "memory_bytes": 16 * 2**30,
                        "memory_bytes_per_second": 5e11,
                        "links": ["lab-link"],
                    }
                },
                "links": {
                    "lab-link": {
                        "nominal_bytes_per_second": 100e9,
                        "achieved_bytes_per_second": 80e9,
                        "latency_seconds": 2e-6,
                    },
                    "pcie4": {"achieved_bytes_per_second": 20e9},
                },
            }
        )
    )
    out = tmp_path / "catalogue.json"
    lines = listing(capsys, "--catalogue", str(mine), "--json", str(out))
    assert rows(lines, "lab-gpu")[0][:4] == ["lab-gpu", "lab-link", "-", "16"]
    assert rows(lines, "lab-link")[0] == ["lab-link", "100", "80", "2", "-", "lab-gpu"]
    assert rows(lines, "pcie4")[0][1:3] == ["31.5", "20"]
    data = json.loads(out.read_text())
    assert set(data) == {"gpus", "links", "networks"}
    assert (
        data["gpus"]["lab-gpu"]["links"] == ["lab-link"] and data["links"]["pcie4"]["achieved_bytes_per_second"] == 20e9
    )
    assert "NVIDIA H100 datasheet" in data["gpus"]["h100-sxm"]["source"]
    only = tmp_path / "links.json"
    listing(capsys, "links", "--json", str(only))
    assert set(json.loads(only.read_text())) == {"links"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["switches"], "section: invalid choice: 'switches'"),
        (["--catalogue", "missing.json"], "--catalogue: catalogue file 'missing.json' does not exist"),
    ],
)
def test_bad_input_is_one_line(args, message, capsys):
    assert main(["catalogue", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_bad_user_file_names_the_entry(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpus": {"t4": {"links": ["nvlink9"]}}}))
    assert main(["catalogue", "--catalogue", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "gpus.t4.links: unknown link 'nvlink9'" in err
