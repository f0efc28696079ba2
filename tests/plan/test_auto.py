"""strategy="auto": the rules (with step times fixed by the test), and real decisions on the launch-bound and the
compute-bound examples (the model traced, the cost model's predictions)."""

import pytest
import torch
from machines import BUSY_2_CORES, cpu_calibration

from dpkit.examples import get_example
from dpkit.plan.auto import choose_strategy
from dpkit.plan.catalogue import Catalogue
from dpkit.plan.configuration import Hardware
from dpkit.plan.probe import measure_probes, probe_strategies
from dpkit.plan.profiles import builtin_profile, given_profile, measure_model
from dpkit.strategies import (
    ALL_PROCESSES,
    ON_ROOT,
    ONE_PROCESS,
    PER_DEVICE,
    PER_STEP,
    PERSISTENT,
    available_strategies,
    matching,
    reference,
    strategy_class,
)

CATALOGUE = Catalogue.load()
A100 = Hardware(CATALOGUE.gpu("a100-80gb-sxm"), CATALOGUE.link("nvlink3"))
CPUS = ["cpu:0", "cpu:1"]
GPUS = ["cuda:0", "cuda:1"]
SINGLE = reference()
DDP = matching(lambda t: t.processes == PER_DEVICE and not t.sharded)[0]
FSDP = matching(lambda t: len(t.sharded_parts) == 3 and t.shard_group == ALL_PROCESSES)[0]  # shards everything
DP = matching(lambda t: t.replicas == PER_STEP and t.loss == ON_ROOT and not t.balances)[0]
REPLICATED = matching(lambda t: t.processes == ONE_PROCESS and t.replicas == PERSISTENT)[0]
SMALL = given_profile(1e6, 1e8, name="small", kernels_per_forward=20, output_bytes_per_sample=40.0)


def steps(**seconds):
    """Step times by strategy, every other strategy far slower (the rule under test decides among these)."""
    names = {"single": SINGLE, "ddp": DDP, "fsdp": FSDP, "dp": DP, "replicated": REPLICATED}
    fixed = {name: 1.0 for name in available_strategies()}
    fixed.update({names[key]: value for key, value in seconds.items()})
    return fixed


def choose(devices=CPUS, **kwargs):
    kwargs.setdefault("calibration", cpu_calibration())
    return choose_strategy(SMALL, None, 64, devices, **kwargs)


# ---- the rules, with step times fixed here --------------------------------------------------------


def test_one_device_is_the_reference_without_looking_further():
    choice = choose(["cpu:0"])
    assert (choice.strategy, choice.devices) == (SINGLE, 1)
    assert choice.reason == f"auto: {SINGLE} — one device"


def test_several_devices_only_when_they_pay_a_tenth_more():
    barely = choose(step_seconds=steps(single=0.010, replicated=0.0095))
    assert barely.strategy == SINGLE
    assert "only 1.05x faster, under the 1.1x" in barely.reason
    pays = choose(step_seconds=steps(single=0.010, replicated=0.004))
    assert (pays.strategy, pays.devices) == (REPLICATED, 2)
    assert pays.reason.startswith(f"auto: {REPLICATED} on 2 devices — 2.50x {SINGLE}'s throughput (measured)")


def test_among_equals_gpus_prefer_a_process_per_device_and_cpus_none():
    numbers = steps(single=0.010, replicated=0.0050, ddp=0.0053)
    on_gpus = choose(GPUS, hardware=A100, calibration=None, step_seconds=numbers)
    assert on_gpus.strategy == DDP
    assert f"{DDP} preferred on GPUs (a process per device, no GIL) to {REPLICATED}" in on_gpus.reason
    on_cpus = choose(step_seconds=numbers)
    assert on_cpus.strategy == REPLICATED
    clearly = choose(
        GPUS, hardware=A100, calibration=None, step_seconds=steps(single=0.01, replicated=0.004, ddp=0.0053)
    )
    assert clearly.strategy == REPLICATED  # more than 10% faster: not an equal


def test_a_process_per_device_only_when_the_caller_can_launch():
    numbers = steps(single=0.010, replicated=0.006, ddp=0.003)
    assert choose(step_seconds=numbers).strategy == DDP
    held = choose(step_seconds=numbers, can_launch=False)
    assert held.strategy == REPLICATED
    assert f"{DDP} would be faster but needs a process per device (can_launch=False)" in held.reason
    assert not held.candidate(DDP).allowed and "can_launch=False" in held.candidate(DDP).note


def test_the_sharded_strategy_only_when_clearly_faster_or_alone_in_fitting():
    assert choose(step_seconds=steps(single=0.010, ddp=0.0042, fsdp=0.0040)).strategy == DDP
    assert choose(step_seconds=steps(single=0.010, ddp=0.0042, fsdp=0.0030)).strategy == FSDP
    # llama-7b on 8 A100s: nothing with a whole copy per device fits, whatever step times are claimed
    llama = builtin_profile("llama-7b", seq_len=2048)
    gpus = [f"cuda:{i}" for i in range(8)]
    choice = choose_strategy(
        llama, None, 8, gpus, "bf16-mixed", "adam", hardware=A100, step_seconds=steps(single=0.001, dp=0.001)
    )
    assert (choice.strategy, choice.devices) == (FSDP, 8)
    assert "nothing unsharded fits" in choice.reason
    assert not choice.candidate(SINGLE).fits and not choice.candidate(DDP).fits
    assert choice.candidate(SINGLE).step_seconds == 0.001  # the claim was heard, and overruled by memory


def test_never_a_strategy_that_cannot_run_at_the_precision():
    no_scaler = [name for name in available_strategies() if not strategy_class(name).traits.grad_scaler]
    assert no_scaler
    choice = choose(
        GPUS, hardware=A100, calibration=None, precision="16-mixed", step_seconds=steps(single=0.01, replicated=0.001)
    )
    assert choice.strategy not in no_scaler
    assert all(not choice.candidate(name).runs for name in no_scaler)


def test_nothing_that_fits_is_one_clear_error():
    llama = builtin_profile("llama-7b", seq_len=2048)
    with pytest.raises(ValueError, match=r"^strategy: auto found no strategy that fits and can run: .*smaller batch"):
        choose_strategy(llama, None, 2, GPUS, "bf16-mixed", "adam", hardware=A100, can_launch=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "batch_size: expected a positive number"),
        ({"batch_size": 1}, "batch_size: 1 samples cannot give each of the 2 devices one"),
        ({"devices": "cpu:0"}, "devices: expected a list of devices"),
        ({"devices": ["cpu:0", "cuda:1"]}, "devices: expected only virtual CPU devices or only CUDA devices"),
        ({"step_seconds": {"warp": 1.0}}, "step_seconds: 'warp' is not one of the candidates"),
        ({"step_seconds": {SINGLE: 0.0}}, "step_seconds: expected positive seconds"),
        ({"strategies": ["warp"]}, "strategies: unknown strategy 'warp'"),
        ({"calibration": 3}, "calibration: expected a Calibration or bench JSON path"),
        ({"optimizer": "lion"}, "optimizer: expected one of adam, adamw, sgd or a torch optimizer"),
    ],
)
def test_bad_input_is_one_line_naming_the_argument(kwargs, message):
    arguments = {"batch_size": 64, "devices": CPUS, "calibration": cpu_calibration(), **kwargs}
    with pytest.raises((ValueError, TypeError), match=message) as raised:
        choose_strategy(SMALL, None, **arguments)
    assert "\n" not in str(raised.value)


def test_a_model_needs_its_sample_input():
    with pytest.raises(ValueError, match="sample_input: expected a batch of inputs"):
        choose_strategy(torch.nn.Linear(4, 2), "x", 8, CPUS, calibration=cpu_calibration())


# ---- real decisions: the examples traced, the cost model's predictions ------------------------------


def example_batch(name):
    example = get_example(name)
    return example.build_model(), example.load_data(0)[0][:4]


def test_launch_bound_on_virtual_cpu_devices_is_single_and_says_why():
    model, x = example_batch("launch-bound")
    for machine in (cpu_calibration(), cpu_calibration(BUSY_2_CORES)):
        torch.manual_seed(7)
        choice = choose_strategy(model, x, 32, CPUS, calibration=machine)
        drawn = torch.rand(2)
        torch.manual_seed(7)
        assert torch.equal(drawn, torch.rand(2))  # the user's random state untouched
        assert (choice.strategy, choice.devices) == (SINGLE, 1), choice.reason
        assert "on this model a step is mostly operation launches" in choice.reason
        assert f"{DP} " in choice.reason  # what DataParallel would cost is said
        dp = choice.candidate(DP)
        assert dp.step_seconds > 1.5 * choice.candidate(SINGLE).step_seconds
    assert all(p.grad is None for p in model.parameters())  # traced on the meta device: the model untouched


def test_launch_bound_on_gpus_is_single_too():
    model, x = example_batch("launch-bound")
    choice = choose_strategy(model, x, 32, GPUS, hardware=A100)
    assert choice.strategy == SINGLE, choice.reason
    assert "mostly operation launches" in choice.reason


def test_wide_output_at_a_batch_where_dp_pays_uses_the_devices():
    model, x = example_batch("wide-output")
    on_gpus = choose_strategy(model, x, 8192, GPUS, hardware=A100)
    assert (on_gpus.strategy, on_gpus.devices) == (DDP, 2), on_gpus.reason
    in_one_process = choose_strategy(model, x, 8192, GPUS, hardware=A100, can_launch=False)
    assert strategy_class(in_one_process.strategy).traits.processes == ONE_PROCESS and in_one_process.devices == 2
    on_cpus = choose_strategy(model, x, 2048, CPUS, calibration=cpu_calibration(), can_launch=False)
    assert on_cpus.devices == 2, on_cpus.reason
    assert on_cpus.candidate(on_cpus.strategy).step_seconds * 1.1 <= on_cpus.candidate(SINGLE).step_seconds


def test_the_probe_measures_the_probe_strategies_on_this_machine():
    # what strategy="auto" fits this machine's constants to when no calibration is given: every probe
    # configuration measured (how fast is this machine's business, not this test's), and the caller's random
    # state and thread count as they were (auto chooses before a seeded run starts)
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    threads = torch.get_num_threads()
    runs = measure_probes(2, budget_seconds=0.2)
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == threads
    assert len(runs) == 2
    for run in runs:
        configurations = {(strategy, devices) for strategy, devices, _ in run.measured}
        assert configurations == {(SINGLE, 1)} | {(name, 2) for name in probe_strategies()}
        assert all(seconds > 0 for *_, seconds in run.measured)
        assert run.batch_size and run.profile.kernels_per_forward > 0
    with pytest.raises(ValueError, match="devices: the probe compares one device with several"):
        measure_probes(1)


def test_a_profile_or_a_module_give_the_same_answer():
    model, x = example_batch("launch-bound")
    profile = measure_model(model, tuple(x.shape[1:]))
    by_module = choose_strategy(model, x, 32, GPUS, hardware=A100)
    by_profile = choose_strategy(profile, None, 32, GPUS, hardware=A100)
    assert [c.step_seconds for c in by_module.candidates] == [c.step_seconds for c in by_profile.candidates]
