import json

import pytest

from dpkit.plan.catalogue import GPU, PRECISIONS, Catalogue, Link

REQUIRED_GPUS = [
    "v100-sxm2",
    "v100-pcie",
    "a100-40gb-sxm",
    "a100-80gb-sxm",
    "a100-40gb-pcie",
    "a100-80gb-pcie",
    "h100-sxm",
    "h100-pcie",
    "h200-sxm",
    "titan-rtx",
    "rtx-3090",
    "rtx-4090",
    "l4",
    "t4",
]
REQUIRED_LINKS = ["pcie3", "pcie4", "pcie5", "nvlink2", "nvlink3", "nvlink4", "nvlink-bridge"]
REQUIRED_NETWORKS = ["eth-10g", "eth-25g", "eth-100g", "ib-100g", "ib-200g", "ib-400g"]


@pytest.fixture(scope="module")
def catalogue():
    return Catalogue.load()


def test_builtins_complete_with_sources(catalogue):
    for name in REQUIRED_GPUS:
        gpu = catalogue.gpu(name)
        assert isinstance(gpu, GPU) and gpu.name == name
        assert set(gpu.peak_flops) == set(PRECISIONS)
        assert all(value > 1e12 for value in gpu.peak_flops.values())
        # FP16 tensor cores are never slower than FP32 on these GPUs
        assert gpu.peak_flops["16-mixed"] >= gpu.peak_flops["32"]
        assert gpu.memory_bytes >= 16 * 2**30 and gpu.memory_bytes_per_second >= 300e9
        assert len(gpu.source) > 20
    for name in REQUIRED_LINKS:
        link = catalogue.link(name)
        assert isinstance(link, Link)
        assert 0 < link.achieved_bytes_per_second <= link.nominal_bytes_per_second
        assert 0 < link.latency_seconds < 1e-3 and len(link.source) > 20
    for name in REQUIRED_NETWORKS:
        network = catalogue.network(name)
        assert 0 < network.achieved_bytes_per_second <= network.nominal_bytes_per_second


def test_figures_order_as_the_generations_do(catalogue):
    links = [catalogue.link(name).nominal_bytes_per_second for name in ("pcie3", "pcie4", "pcie5")]
    assert links == sorted(links) and links[1] == pytest.approx(2 * links[0], rel=0.01)
    nvlinks = [catalogue.link(name).nominal_bytes_per_second for name in ("nvlink2", "nvlink3", "nvlink4")]
    assert nvlinks == sorted(nvlinks)
    assert catalogue.link("nvlink-bridge").max_devices == 2
    assert catalogue.gpu("h200-sxm").peak_flops == catalogue.gpu("h100-sxm").peak_flops
    assert catalogue.gpu("h200-sxm").memory_bytes > catalogue.gpu("h100-sxm").memory_bytes
    assert catalogue.gpu("a100-80gb-sxm").memory_bytes == 2 * catalogue.gpu("a100-40gb-sxm").memory_bytes
    assert catalogue.network("ib-400g").nominal_bytes_per_second == pytest.approx(400e9 / 8)
    assert catalogue.network("eth-10g").nominal_bytes_per_second == pytest.approx(10e9 / 8)


def test_lookups_ignore_case_and_separators(catalogue):
    assert catalogue.gpu("H100-SXM") is catalogue.gpu("h100-sxm")
    assert catalogue.gpu(" rtx_4090 ") is catalogue.gpu("rtx-4090")
    assert catalogue.link("PCIe4") is catalogue.link("pcie4")
    assert catalogue.network("IB-200G") is catalogue.network("ib-200g")


@pytest.mark.parametrize("method, name", [("gpu", "h300"), ("link", "nvlink9"), ("network", "carrier-pigeon")])
def test_unknown_name_is_one_line_with_choices(catalogue, method, name):
    with pytest.raises(ValueError) as info:
        getattr(catalogue, method)(name)
    message = str(info.value)
    assert "\n" not in message and repr(name) in message
    table = {"gpu": catalogue.gpus, "link": catalogue.links, "network": catalogue.networks}[method]
    assert all(choice in message for choice in table)


@pytest.mark.parametrize(
    "device_name, expected",
    [
        ("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb-pcie"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
        ("Tesla V100-SXM2-32GB", "v100-sxm2"),
        ("Tesla V100-PCIE-16GB", "v100-pcie"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200-sxm"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA GeForce RTX 3090", "rtx-3090"),
        ("NVIDIA TITAN RTX", "titan-rtx"),
        ("NVIDIA L4", "l4"),
        ("Tesla T4", "t4"),
    ],
)
def test_match_gpu_from_torch_device_names(catalogue, device_name, expected):
    assert catalogue.match_gpu(device_name).name == expected


def test_match_gpu_unknown_is_none(catalogue):
    assert catalogue.match_gpu("NVIDIA GeForce GTX 1080") is None
    assert catalogue.match_gpu("") is None
    assert catalogue.match_gpu("NVIDIA GH200 480GB") is None


def test_user_json_adds_and_overrides(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(
        json.dumps(
            {
                "gpus": {
                    "My-GPU": {
                        "peak_flops": {"32": 1e13, "tf32": 2e13, "bf16-mixed": 4e13, "16-mixed": 4e13},
                        "memory_bytes": 8 * 2**30,
                        "memory_bytes_per_second": 4e11,
                        "source": "lab notes",
                    },
                    "h100-sxm": {"peak_flops": {"bf16-mixed": 700e12}},
                },
                "links": {"pcie4": {"achieved_bytes_per_second": 20e9, "source": "our rack"}},
                "networks": {
                    "roce-200g": {
                        "nominal_bytes_per_second": 25e9,
                        "achieved_bytes_per_second": 22e9,
                        "latency_seconds": 5e-6,
                    }
                },
            }
        )
    )
    builtin = Catalogue.load()
    catalogue = Catalogue.load(path)
    mine = catalogue.gpu("my-gpu")
    assert mine.peak_flops["tf32"] == 2e13 and mine.memory_bytes == 8 * 2**30 and mine.source == "lab notes"
    h100 = catalogue.gpu("h100-sxm")
    assert h100.peak_flops["bf16-mixed"] == 700e12
    assert h100.peak_flops["32"] == builtin.gpu("h100-sxm").peak_flops["32"]  # untouched fields stay
    assert catalogue.link("pcie4").achieved_bytes_per_second == 20e9
    assert catalogue.link("pcie4").nominal_bytes_per_second == builtin.link("pcie4").nominal_bytes_per_second
    assert str(path) in catalogue.network("roce-200g").source  # no source given: the file is named
    assert "my-gpu" not in builtin.gpus  # loading a user file leaves the built-ins alone


def test_user_toml(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(
        "[links.my-link]\nnominal_bytes_per_second = 10e9\nachieved_bytes_per_second = 8e9\n"
        'latency_seconds = 2e-6\nmax_devices = 4\nsource = "vendor sheet"\n'
    )
    link = Catalogue.load(path).link("my-link")
    assert (link.nominal_bytes_per_second, link.achieved_bytes_per_second, link.max_devices) == (10e9, 8e9, 4)


@pytest.mark.parametrize(
    "content, expected",
    [
        (
            {"gpus": {"x": {"peak_flops": {"32": 1e13}, "memory_bytes": 1, "memory_bytes_per_second": 1}}},
            "gpus.x.peak_flops: missing precision 'tf32'",
        ),
        (
            {
                "gpus": {
                    "x": {
                        "peak_flops": {"32": 1, "tf32": 1, "bf16-mixed": 1, "16-mixed": 1, "fp8": 1},
                        "memory_bytes": 1,
                        "memory_bytes_per_second": 1,
                    }
                }
            },
            "gpus.x.peak_flops.fp8: unknown precision",
        ),
        ({"gpus": {"h100-sxm": {"memory_bytes": -5}}}, "gpus.h100-sxm.memory_bytes: expected a positive integer"),
        ({"gpus": {"x": {"memory_bytes": 1}}}, "gpus.x: missing field 'peak_flops'"),
        ({"links": {"pcie4": {"bandwidth": 3}}}, "links.pcie4.bandwidth: unknown field"),
        ({"links": {"pcie4": {"achieved_bytes_per_second": 1e12}}}, "exceeds nominal_bytes_per_second"),
        ({"links": {"pcie4": {"latency_seconds": "fast"}}}, "links.pcie4.latency_seconds: expected a positive number"),
        ({"networks": {"eth-10g": {"max_devices": 1}}}, "networks.eth-10g.max_devices: expected an integer >= 2"),
        ({"switches": {}}, "unknown section 'switches'"),
        ({"gpus": {"x": 3}}, "gpus.x: expected a table of fields"),
    ],
)
def test_bad_user_entry_is_one_clear_line(tmp_path, content, expected):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError) as info:
        Catalogue.load(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and expected in message


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        Catalogue.load(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Catalogue.load(broken)
    other = tmp_path / "hardware.yaml"
    other.write_text("gpus: {}")
    with pytest.raises(ValueError, match=r"\.json or \.toml"):
        Catalogue.load(other)


def test_every_gpu_names_its_usual_link_and_its_host_link(catalogue):
    for name, gpu in catalogue.gpus.items():
        assert gpu.links and all(link in catalogue.links for link in gpu.links), name
        assert catalogue.usual_link(name) is catalogue.link(gpu.links[0])
        assert catalogue.host_link(name).name.startswith("pcie")
        # an SXM board's GPUs are joined by NVLink; a PCIe card's by its PCIe generation (or a bridge, after it)
        assert gpu.usual_link.startswith("nvlink" if "sxm" in name else "pcie"), name
        if "pcie" in name:
            assert gpu.usual_link == gpu.host_link
    assert catalogue.usual_link("H100-SXM").name == "nvlink4"  # names ignore case, as everywhere
    assert [link.name for link in catalogue.links_of("rtx-3090")] == ["pcie4", "nvlink-bridge"]
    assert catalogue.gpus_with_link("nvlink-bridge") == ["rtx-3090"]
    assert set(catalogue.gpus_with_link("nvlink4")) == {"h100-sxm", "h200-sxm"}


def test_user_file_gives_links_and_a_new_gpu_may_have_none(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(
        json.dumps(
            {
                "gpus": {
                    "my-gpu": {
                        "peak_flops": {"32": 1e13, "tf32": 2e13, "bf16-mixed": 4e13, "16-mixed": 4e13},
                        "memory_bytes": 8 * 2**30,
                        "memory_bytes_per_second": 4e11,
                    },
                    "a100-80gb-pcie": {"links": ["pcie4", "my-bridge"]},
                },
                "links": {
                    "my-bridge": {
                        "nominal_bytes_per_second": 300e9,
                        "achieved_bytes_per_second": 200e9,
                        "latency_seconds": 3e-6,
                        "max_devices": 2,
                    }
                },
            }
        )
    )
    catalogue = Catalogue.load(path)
    assert catalogue.usual_link("my-gpu") is None and catalogue.links_of("my-gpu") == []
    assert [link.name for link in catalogue.links_of("a100-80gb-pcie")] == ["pcie4", "my-bridge"]
    assert catalogue.host_link("a100-80gb-pcie").name == "pcie4"  # untouched fields stay
    assert catalogue.to_dict()["gpus"]["a100-80gb-pcie"]["links"] == ["pcie4", "my-bridge"]


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"links": ["nvlink9"]}, "gpus.t4.links: unknown link 'nvlink9'"),
        ({"links": "pcie3"}, "gpus.t4.links: expected a list of link names"),
        ({"host_link": "pcie9"}, "gpus.t4.host_link: unknown link 'pcie9'"),
        ({"host_link": 3}, "gpus.t4.host_link: expected a link name"),
    ],
)
def test_a_gpu_names_only_links_of_the_catalogue(tmp_path, body, expected):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"gpus": {"t4": body}}))
    with pytest.raises(ValueError) as info:
        Catalogue.load(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value) and expected in str(info.value)


def test_unknown_names_point_to_dpkit_catalogue(catalogue):
    for method, section in (("gpu", "gpus"), ("link", "links"), ("network", "networks")):
        with pytest.raises(ValueError, match=f"`dpkit catalogue {section}` lists them"):
            getattr(catalogue, method)("nothing-of-the-kind")


def test_to_dict_round_trips_through_a_user_file(tmp_path, catalogue):
    path = tmp_path / "copy.json"
    path.write_text(json.dumps(catalogue.to_dict()))
    again = Catalogue.load(path)
    assert again.gpus == catalogue.gpus and again.links == catalogue.links and again.networks == catalogue.networks
