import pytest
import torch

import dpkit
from dpkit.devices import parse_device, parse_device_list, resolve_devices, tensor_on


def test_cpu_devices_are_indexed_virtual_devices():
    assert dpkit.cpu_devices(3) == [torch.device("cpu", 0), torch.device("cpu", 1), torch.device("cpu", 2)]
    with pytest.raises(ValueError, match="n: expected a positive int"):
        dpkit.cpu_devices(0)


@pytest.mark.parametrize("spec, expected", [
    (1, torch.device("cuda", 1)),
    ("cuda:2", torch.device("cuda", 2)),
    ("cpu:3", torch.device("cpu", 3)),
    ("cpu", torch.device("cpu", 0)),
    (torch.device("cpu", 1), torch.device("cpu", 1)),
])
def test_parse_device(spec, expected):
    assert parse_device(spec) == expected


def test_parse_device_rejects_nonsense():
    with pytest.raises(ValueError, match="not a device"):
        parse_device("gpu:1")
    with pytest.raises(TypeError):
        parse_device(1.5)
    with pytest.raises(TypeError):
        parse_device(True)


def test_device_list_rules():
    with pytest.raises(ValueError, match="empty"):
        parse_device_list([])
    with pytest.raises(ValueError, match="appears twice"):
        parse_device_list(["cpu:0", "cpu:0"])
    with pytest.raises(ValueError, match="mixed device types"):
        parse_device_list(["cpu:0", 1])
    with pytest.raises(TypeError, match="wrap it in a list"):
        parse_device_list("cpu:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_none_without_gpu_says_how_to_use_cpu_devices():
    with pytest.raises(ValueError, match="cpu_devices"):
        parse_device_list(None)


def test_resolve_devices_for_command_line():
    assert resolve_devices("cpu", 3) == dpkit.cpu_devices(3)
    assert resolve_devices("cpu", "2") == dpkit.cpu_devices(2)
    with pytest.raises(ValueError, match="accelerator"):
        resolve_devices("tpu", 1)
    with pytest.raises(ValueError, match="devices"):
        resolve_devices("cpu", 0)


def test_cpu_tensors_are_on_every_virtual_device():
    t = torch.zeros(1)
    assert tensor_on(t, torch.device("cpu", 5))
    assert not tensor_on(t, torch.device("cuda", 0))
