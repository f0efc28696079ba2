import pytest
import torch

import dpkit
from dpkit.devices import parse_device, parse_device_list, resolve_devices, tensor_on


def test_cpu_devices_are_indexed_virtual_devices():
    assert dpkit.cpu_devices(3) == [torch.device("cpu", 0), torch.device("cpu", 1), torch.device("cpu", 2)]
    with pytest.raises(ValueError, match="n: expected a positive int"):
        dpkit.cpu_devices(0)


@pytest.mark.parametrize(
    "spec, expected",
    [
        (1, torch.device("cuda", 1)),
        ("cuda:2", torch.device("cuda", 2)),
        ("cpu:3", torch.device("cpu", 3)),
        ("cpu", torch.device("cpu", 0)),
        (torch.device("cpu", 1), torch.device("cpu", 1)),
    ],
)
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


@pytest.mark.parametrize("count", [129, 257, 1000])
def test_counts_past_torchs_8_bit_index_are_refused(count):
    # torch.device("cpu", 128) is cpu:-128 and torch.device("cpu", 256) is cpu:0: two replicas would share a device
    assert torch.device("cpu", 256) == torch.device("cpu", 0)
    with pytest.raises(ValueError, match=f"devices: {count} devices is past torch's limit of 128") as error:
        resolve_devices("cpu", count)
    assert "appears twice" not in str(error.value)
    assert len(resolve_devices("cpu", 128)) == 128 and resolve_devices("cpu", 128)[-1] == torch.device("cpu", 127)


@pytest.mark.parametrize("spec", ["cpu:128", "cpu:300", 300, torch.device("cpu", 200)])
def test_indices_past_the_limit_are_refused_not_wrapped(spec):
    with pytest.raises(ValueError, match="past torch's limit of 127|negative index"):
        parse_device(spec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize("device_ids", [[0], ["cuda:0"], [0, 1]])
def test_gpus_this_machine_lacks_are_an_error_at_construction(device_ids):
    with pytest.raises(
        ValueError,
        match=r"device_ids\[0\]: cuda:0 does not exist on this machine \(no GPU is visible\); "
        r"for virtual CPU devices use 'cpu:0'.*dpkit.cpu_devices\(n\).*accelerator=cpu",
    ):
        dpkit.DataParallel(torch.nn.Linear(2, 2), device_ids)


@pytest.mark.parametrize("devices", ["0,1", "cuda:0,cuda:1", [0, 1]])
def test_cuda_devices_with_the_cpu_accelerator_is_one_clear_error(devices):
    with pytest.raises(ValueError, match="names cuda devices but accelerator='cpu'"):
        resolve_devices("cpu", devices)


def test_process_count_is_capped_by_the_cores_unless_forced():
    from dpkit.devices import PROCESSES_PER_CORE, available_cores, check_process_count

    limit = PROCESSES_PER_CORE * available_cores()
    check_process_count(limit)
    with pytest.raises(ValueError, match=f"{limit + 1} processes on {available_cores()} CPU core"):
        check_process_count(limit + 1)
    check_process_count(limit + 1, force=True)
