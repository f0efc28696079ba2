"""The cost model's formulas, and the behaviour that follows from them."""

import dataclasses
from dataclasses import replace

import pytest
from machines import memory

from dpkit.plan.catalogue import Catalogue, Link
from dpkit.plan.communication import exposed_all_reduce_seconds
from dpkit.plan.configuration import BatchSize, Hardware, Setup
from dpkit.plan.constants import OPTIMIZER_STATE_BYTES_PER_PARAMETER, CostConstants
from dpkit.plan.cost_model import predict, predict_all
from dpkit.plan.memory import Sizing
from dpkit.plan.profiles import builtin_profile, given_profile
from dpkit.plan.transfers import ring_all_gather_seconds, ring_all_reduce_seconds, root_fan_seconds, transfer_seconds
from dpkit.strategies import (
    ALL_PROCESSES,
    ONE_PROCESS,
    PER_DEVICE,
    Strategy,
    available_strategies,
    matching,
    strategy_class,
)

CATALOGUE = Catalogue.load()
LINK = Link("test", 10e9, 10e9, 1e-5, "test")


# strategies the cost model has never heard of: it knows them only by the traits they declare
class LikeDDP(Strategy):
    name = "like-ddp"
    traits = strategy_class("ddp").traits


class LikeDP(Strategy):
    name = "like-dp"
    traits = strategy_class("dp").traits


class LikeFSDP(Strategy):
    name = "like-fsdp"
    traits = strategy_class("fsdp").traits


class DDPInOneProcess(Strategy):
    """ddp's traits but one process driving every device: one trait changed."""

    name = "ddp-in-one-process"
    traits = dataclasses.replace(strategy_class("ddp").traits, processes=ONE_PROCESS)


@pytest.fixture
def unknown_names(monkeypatch):
    """Registers the classes above in the strategy registry, under names no code compares."""
    from dpkit import strategies

    for cls in (LikeDDP, LikeDP, LikeFSDP, DDPInOneProcess):
        monkeypatch.setitem(strategies.STRATEGIES, cls.name, f"{__name__}:{cls.__name__}")


def test_alpha_beta_transfer():
    assert transfer_seconds(LINK, 1e9) == pytest.approx(1e-5 + 0.1)
    assert transfer_seconds(LINK, 1e9, messages=3) == pytest.approx(3e-5 + 0.1)


def test_ring_all_reduce_moves_2_n_minus_1_over_n_of_the_bytes():
    for devices in (2, 4, 8):
        expected = 2 * (devices - 1) * 1e-5 + 2 * (devices - 1) / devices * 1e9 / 10e9
        assert ring_all_reduce_seconds(LINK, 1e9, devices) == pytest.approx(expected)
    assert ring_all_reduce_seconds(LINK, 1e9, 1) == 0.0
    # the bytes per device approach twice the message, so time barely grows from 4 to 8 devices
    assert ring_all_reduce_seconds(LINK, 1e9, 8) / ring_all_reduce_seconds(LINK, 1e9, 4) < 1.2


def test_broadcast_through_one_root_grows_with_the_other_devices():
    assert root_fan_seconds(LINK, 1e9, 0) == 0.0
    assert root_fan_seconds(LINK, 1e9, 7) == pytest.approx(7 * (1e-5 + 0.1))


def test_ddp_hides_the_all_reduce_behind_backward_except_the_last_bucket():
    profile = builtin_profile("resnet50")  # ~102 MB of gradients: 4 buckets of 25 MiB
    hardware = Hardware(CATALOGUE.gpu("a100-80gb-sxm"), CATALOGUE.link("pcie4"))
    buckets = -(-profile.parameter_bytes // CostConstants().bucket_bytes)
    assert buckets == 4
    whole = ring_all_reduce_seconds(hardware.link, profile.parameter_bytes, 8, messages=buckets)
    setup = Setup(profile, hardware, "ddp", 8, 1)
    long_backward = exposed_all_reduce_seconds(setup, backward_seconds=10.0)
    no_backward = exposed_all_reduce_seconds(setup, backward_seconds=0.0)
    assert long_backward == pytest.approx(whole / buckets)
    assert no_backward == pytest.approx(whole)


def test_dp_pays_per_step_replication_and_reduce_that_ddp_does_not():
    profile = builtin_profile("gpt2-124m", seq_len=1024)
    hardware = Hardware(CATALOGUE.gpu("h100-sxm"), CATALOGUE.link("pcie4"))
    dp = predict(profile, hardware, "dp", 8, 8, "bf16-mixed")
    ddp = predict(profile, hardware, "ddp", 8, 8, "bf16-mixed")
    assert dp.breakdown["replicate"] > 0 and dp.breakdown["reduce"] > 0 and dp.breakdown["gather"] > 0
    assert "replicate" not in ddp.breakdown and "all_reduce" in ddp.breakdown
    assert ddp.samples_per_second > dp.samples_per_second


def test_dp_stops_scaling_on_a_slow_link_and_ddp_keeps_going():
    profile = builtin_profile("gpt2-124m", seq_len=1024)
    hardware = Hardware(CATALOGUE.gpu("h100-sxm"), CATALOGUE.link("pcie4"))
    plan = predict_all(profile, hardware, ["single", "dp", "ddp"], [1, 2, 4, 8], 8, "bf16-mixed")
    dp = {p.devices: p.samples_per_second for p in plan if p.strategy == "dp"}
    ddp = {p.devices: p.samples_per_second for p in plan if p.strategy == "ddp"}
    assert dp[8] < 2 * dp[1]
    assert ddp[8] > ddp[4] > ddp[2] > ddp[1]


def test_a_faster_link_only_helps_communication():
    profile = builtin_profile("bert-base")
    slow = Hardware(CATALOGUE.gpu("a100-80gb-sxm"), CATALOGUE.link("pcie3"))
    fast = replace(slow, link=CATALOGUE.link("nvlink3"))
    for strategy in ("dp", "ddp"):
        a, b = predict(profile, slow, strategy, 4, 32), predict(profile, fast, strategy, 4, 32)
        assert b.step_seconds < a.step_seconds
        assert a.breakdown["forward"] == b.breakdown["forward"]


def test_dp_device_zero_holds_the_optimizer_state_and_the_gathered_outputs():
    profile = builtin_profile("gpt2-124m", seq_len=1024)
    peaks, _ = memory(profile, "dp", 4, 8)
    ddp_peaks, _ = memory(profile, "ddp", 4, 8)
    assert peaks[0] > peaks[1] == peaks[2] == peaks[3]
    assert len(set(ddp_peaks)) == 1


def test_on_virtual_cpu_devices_only_optimizer_steps_that_run_at_once_crowd_the_cores():
    # one pool of 2 cores shared by 3 virtual devices: the replicas' forwards crowd it, but dp steps the
    # optimizer once in the calling thread while the replicas wait, replicated on shared weights splits
    # its one step among the replicas' threads, and ddp's processes each step their own copy at once
    profile = builtin_profile("resnet50")
    cpu = replace(CATALOGUE.gpu("a100-80gb-sxm"), memory_bytes_per_second=20e9)
    hardware = Hardware(cpu, LINK, shared_compute=True, compute_slots=2.0)

    def optimizer(strategy, devices):
        return predict(profile, hardware, strategy, devices, 32).breakdown["optimizer"]

    alone = optimizer("single", 1)
    assert optimizer("dp", 3) == pytest.approx(alone)
    assert optimizer("dp-balanced", 3) == pytest.approx(alone)
    assert optimizer("replicated", 2) < 0.6 * alone  # two threads, two cores: about half
    assert optimizer("replicated", 3) == pytest.approx(optimizer("replicated", 2))  # the cores bound the split
    assert optimizer("ddp", 3) == pytest.approx(1.5 * alone, rel=0.05)  # 3 copies on 2 cores
    forward = {n: predict(profile, hardware, "dp", n, 32).breakdown["forward"] for n in (1, 3)}
    assert forward[3] == pytest.approx(1.5 * forward[1])


def test_replicated_on_virtual_cpu_devices_holds_one_copy_of_the_weights_and_state():
    # virtual CPU devices: replicas are views of replica 0's weights, stepped once by one optimizer
    profile = builtin_profile("resnet50")
    params, state = profile.parameter_bytes, 8 * profile.parameters  # Adam: two moments
    shared, _ = memory(profile, "replicated", 3, 0, shared_weights=True)
    assert shared == [2 * params + state, params, params]  # the others: their gradients until the sum
    copies, _ = memory(profile, "replicated", 3, 0)  # GPUs: a copy and a state per device
    assert copies == [2 * params + state] * 3
    cpu = Hardware(replace(CATALOGUE.gpu("a100-80gb-sxm"), memory_bytes_per_second=20e9), LINK, shared_compute=True)
    assert predict(profile, cpu, "replicated", 3, 1).peak_bytes_per_device[1] < copies[1]


def test_largest_batch_fits_and_one_more_does_not():
    profile = builtin_profile("resnet50")
    hardware = Hardware(CATALOGUE.gpu("t4"), CATALOGUE.link("pcie3"))
    largest = predict(profile, hardware, "ddp", 2, 1).max_batch_per_device
    usable = hardware.gpu.memory_bytes * CostConstants().memory_headroom
    assert max(memory(profile, "ddp", 2, largest)[0]) <= usable
    assert max(memory(profile, "ddp", 2, largest + 1)[0]) > usable
    assert "does not fit" in predict(profile, hardware, "ddp", 2, largest + 50).notes[0]


def test_multi_node_ddp_is_bound_by_the_slower_network():
    profile = builtin_profile("bert-large")
    node = Hardware(CATALOGUE.gpu("a100-80gb-sxm"), CATALOGUE.link("nvlink3"))
    two_slow = replace(node, nodes=2, network=CATALOGUE.network("eth-10g"))
    two_fast = replace(node, nodes=2, network=CATALOGUE.network("ib-400g"))
    slow, fast = predict(profile, two_slow, "ddp", 8, 16), predict(profile, two_fast, "ddp", 8, 16)
    assert slow.breakdown["all_reduce"] > 10 * fast.breakdown["all_reduce"]
    # only ddp spans nodes; speed-ups are against one device on one node
    planned = predict_all(profile, two_fast, ["single", "dp", "ddp"], [1, 8], 16)
    assert [(p.strategy, p.devices, p.nodes) for p in planned] == [("single", 1, 1), ("ddp", 1, 2), ("ddp", 8, 2)]


def test_bad_arguments_name_themselves():
    profile = builtin_profile("resnet50")
    hardware = Hardware(CATALOGUE.gpu("t4"), CATALOGUE.link("pcie3"))
    with pytest.raises(ValueError, match="strategy: unknown strategy 'nonesuch'"):
        predict(profile, hardware, "nonesuch", 2, 8)
    with pytest.raises(ValueError, match="batch_per_device: expected at least 1, got 0"):
        predict(profile, hardware, "ddp", 2, 0)
    with pytest.raises(ValueError, match="precision: expected 32, tf32"):
        predict(profile, hardware, "ddp", 2, 8, precision="fp8")


def comparable(prediction):
    return (
        prediction.step_seconds,
        prediction.breakdown,
        prediction.peak_bytes_per_device,
        prediction.max_batch_per_device,
        prediction.notes,
    )


HARDWARE = {
    "gpus on pcie": Hardware(CATALOGUE.gpu("a100-80gb-sxm"), CATALOGUE.link("pcie4")),
    "two nodes, gloo between processes": Hardware(
        CATALOGUE.gpu("h100-sxm"),
        CATALOGUE.link("nvlink4"),
        CATALOGUE.network("ib-200g"),
        nodes=2,
        interprocess=CATALOGUE.link("pcie3"),
    ),
    "virtual cpu devices": Hardware(
        replace(CATALOGUE.gpu("a100-80gb-sxm"), memory_bytes_per_second=20e9),
        LINK,
        shared_compute=True,
        compute_slots=2.0,
        interprocess=CATALOGUE.link("pcie3"),
    ),
}


@pytest.mark.parametrize("hardware", HARDWARE.values(), ids=HARDWARE.keys())
@pytest.mark.parametrize("like, known", [("like-ddp", "ddp"), ("like-dp", "dp"), ("like-fsdp", "fsdp")])
def test_a_strategy_is_predicted_from_its_traits_not_its_name(unknown_names, hardware, like, known):
    profile = builtin_profile("gpt2-124m", seq_len=1024)
    for devices in (1, 2, 4):
        for precision, optimizer in (("32", "adam"), ("bf16-mixed", "sgd")):
            ours = predict(profile, hardware, like, devices, 8, precision, optimizer=optimizer)
            theirs = predict(profile, hardware, known, devices, 8, precision, optimizer=optimizer)
            assert comparable(ours) == comparable(theirs)
            assert ours.strategy == like
        for shared_weights in (False, True):
            assert memory(profile, like, 4, 8, shared_weights=shared_weights) == memory(
                profile, known, 4, 8, shared_weights=shared_weights
            )
    planned = predict_all(profile, hardware, ["single", known, like], [1, 2, 4], 8)
    ours = [(p.devices, p.nodes, p.speedup, p.breakdown) for p in planned if p.strategy == like]
    theirs = [(p.devices, p.nodes, p.speedup, p.breakdown) for p in planned if p.strategy == known]
    assert ours == theirs
    # ddp's and fsdp's traits span every node; dp's drive one node's devices from one process: none across two
    if strategy_class(known).traits.processes == PER_DEVICE:
        expected_nodes = {hardware.nodes}
    else:
        expected_nodes = {1} if hardware.nodes == 1 else set()
    assert {nodes for _, nodes, _, _ in ours} == expected_nodes


def test_changing_one_trait_changes_what_that_trait_decides(unknown_names):
    # ddp in one process: the process loads the batch and scatters it, its replicas' threads take turns
    # launching, it steps every replica's copy itself, keeps no second copy of the gradients for buckets,
    # talks over the node link rather than between processes, and cannot reach another node
    profile = builtin_profile("resnet50")
    hardware = HARDWARE["two nodes, gloo between processes"]
    one_node = replace(hardware, nodes=1)
    ddp, threads = (predict(profile, one_node, name, 4, 32) for name in ("ddp", "ddp-in-one-process"))
    assert "scatter" not in ddp.breakdown and threads.breakdown["scatter"] > 0
    assert threads.breakdown["overhead"] > ddp.breakdown["overhead"]
    assert threads.breakdown["all_reduce"] < ddp.breakdown["all_reduce"]  # nvlink4 instead of pcie3
    assert threads.peak_bytes_per_device[0] == ddp.peak_bytes_per_device[0] - profile.parameter_bytes
    assert "replicate" not in threads.breakdown and "reduce" not in threads.breakdown  # its replicas persist
    planned = predict_all(profile, hardware, ["ddp", "ddp-in-one-process"], [1, 4], 32)
    assert [(p.strategy, p.devices, p.nodes) for p in planned] == [("ddp", 1, 2), ("ddp", 4, 2)]


# ---- sharded strategies (ZeRO-3 / FSDP): memory and communication ----------------------------------------

# the strategy that shards weights, gradients and optimizer state over every process, whatever its name (fsdp)
SHARDED = matching(lambda traits: len(traits.sharded_parts) == 3 and traits.shard_group == ALL_PROCESSES)[0]
UNSHARDED_PER_DEVICE = matching(lambda traits: traits.processes == PER_DEVICE and not traits.sharded)[0]


def zero3_bytes(profile, devices, precision, optimizer="adam"):
    """Rajbhandari et al. 2020, section 3.1 and figure 1: 2 + 2 + K bytes per parameter under mixed precision
    (16-bit parameters and gradients, K = 12 for Adam's float32 master copy, momentum and variance; 8 for SGD's
    master copy and momentum), 4 + 4 + state in float32; all of it divided by N under ZeRO-3. Plus the largest
    unit gathered: its parameters in the gather dtype, twice (the next one is prefetched), and its gradient in
    float32 before the reduce-scatter."""
    mixed = precision in ("bf16-mixed", "16-mixed")
    state = {"adam": 8, "sgd": 4}[optimizer]
    per_parameter = 2 + 2 + (4 + state) if mixed else 4 + 4 + state
    gather = 2 if mixed else 4
    unit = profile.unit_parameters
    return per_parameter * profile.parameters / devices + 2 * gather * unit + 4 * unit


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_sharded_memory_is_the_state_over_n_plus_the_gathered_unit(precision, optimizer):
    profile = builtin_profile("llama-7b")
    assert 200e6 < profile.unit_parameters < 205e6  # a LLaMA-7B block: 4 x 4096^2 + 3 x 4096 x 11008
    for devices in (1, 2, 3, 8, 64):
        peaks, slopes = memory(profile, SHARDED, devices, 0, precision, optimizer)
        assert len(peaks) == devices and len(set(peaks)) == 1  # every process holds its shard alike
        assert peaks[0] == pytest.approx(zero3_bytes(profile, devices, precision, optimizer), abs=devices)
        # the activations are each device's own, as under ddp
        assert slopes == memory(profile, UNSHARDED_PER_DEVICE, devices, 0, precision, optimizer)[1]


def test_sharded_memory_falls_with_the_devices_and_unsharded_does_not():
    profile = builtin_profile("gpt2-1.5b")
    for precision in ("32", "bf16-mixed"):
        sharded = [max(memory(profile, SHARDED, n, 4, precision)[0]) for n in (2, 4, 8, 16)]
        whole = [max(memory(profile, UNSHARDED_PER_DEVICE, n, 4, precision)[0]) for n in (2, 4, 8, 16)]
        assert sharded == sorted(sharded, reverse=True) and len(set(sharded)) == 4
        assert len(set(whole)) == 1
        assert sharded[0] < whole[0]
    # over two nodes the state is split over every process of both
    two_nodes, _ = memory(profile, SHARDED, 4, 4, "bf16-mixed", nodes=2)
    assert two_nodes == memory(profile, SHARDED, 8, 4, "bf16-mixed")[0][:4]


def test_sharded_offload_leaves_the_gathered_units_and_the_activations():
    profile = builtin_profile("llama-7b")
    on_device, slopes = memory(profile, SHARDED, 8, 1, "bf16-mixed", offload=True)
    unit = profile.unit_parameters
    assert on_device[0] == pytest.approx(2 * 2 * unit + 4 * unit + slopes[0], abs=1)
    # the strategies that keep whole copies ignore it
    assert memory(profile, "ddp", 8, 1, offload=True) == memory(profile, "ddp", 8, 1)


def test_mixed_precision_counts_autocasts_16_bit_weights_where_the_model_is_whole():
    # autocast keeps float32 parameters and gradients and casts every weight to 16 bits for the forward; the
    # casts are saved for backward: 2 bytes per parameter more, less the halved activations. A sharded strategy
    # gathers 16-bit units instead: less than in float32
    profile = builtin_profile("bert-large")
    for strategy in ("ddp", "dp", "replicated"):
        fixed_32 = memory(profile, strategy, 2, 0, "32")[0]
        fixed_16 = memory(profile, strategy, 2, 0, "bf16-mixed")[0]
        assert [b - a for a, b in zip(fixed_32, fixed_16)] == [2 * profile.parameters] * 2
    assert memory(profile, SHARDED, 2, 0, "bf16-mixed")[0] < memory(profile, SHARDED, 2, 0)[0]


def test_ring_all_gather_is_half_an_all_reduce():
    for devices in (2, 4, 8):
        expected = (devices - 1) * 1e-5 + (devices - 1) / devices * 1e9 / 10e9
        assert ring_all_gather_seconds(LINK, 1e9, devices) == pytest.approx(expected)
    assert ring_all_gather_seconds(LINK, 1e9, 1) == 0.0
    assert 2 * ring_all_gather_seconds(LINK, 1e9, 8) == pytest.approx(ring_all_reduce_seconds(LINK, 1e9, 8))


def test_sharded_communication_is_one_and_a_half_all_reduces_in_fp32():
    # ZeRO-3: an all-gather of the parameters in forward, another in backward and a reduce-scatter of the
    # gradients: 3 x (N-1)/N of the bytes against the all-reduce's 2 x (N-1)/N (Rajbhandari et al. 2020,
    # section 7.2). Where nothing overlaps (virtual CPU devices) and latency is nil, the phases show it whole.
    profile = builtin_profile("gpt2-124m", seq_len=1024)
    no_latency = Link("no latency", 10e9, 10e9, 0.0, "test")
    cpu = Hardware(
        replace(CATALOGUE.gpu("a100-80gb-sxm"), memory_bytes_per_second=20e9), no_latency, shared_compute=True
    )
    for devices in (2, 4):
        sharded = predict(profile, cpu, SHARDED, devices, 1).breakdown
        whole = predict(profile, cpu, UNSHARDED_PER_DEVICE, devices, 1).breakdown
        assert "all_reduce" not in sharded and "all_gather" not in whole
        assert sharded["all_gather"] + sharded["reduce_scatter"] == pytest.approx(1.5 * whole["all_reduce"])
        assert sharded["all_gather"] == pytest.approx(2 * sharded["reduce_scatter"])
        # mixed precision gathers 16-bit parameters; the gradients are reduced in float32
        mixed = predict(profile, cpu, SHARDED, devices, 1, "bf16-mixed").breakdown
        assert mixed["all_gather"] == pytest.approx(sharded["all_gather"] / 2)
        assert mixed["reduce_scatter"] == pytest.approx(sharded["reduce_scatter"])


def test_sharded_collectives_hide_behind_compute_on_gpus_but_the_largest_unit_shows():
    profile = builtin_profile("llama-7b")
    hardware = Hardware(CATALOGUE.gpu("h100-sxm"), CATALOGUE.link("nvlink4"))
    long_steps = predict(profile, hardware, SHARDED, 8, 4, "bf16-mixed").breakdown
    share = profile.unit_parameters / profile.parameters
    gather = ring_all_gather_seconds(hardware.link, 2 * profile.parameters, 8, profile.units)
    scatter = ring_all_gather_seconds(hardware.link, 4 * profile.parameters, 8, profile.units)
    # compute is long enough to hide all but the largest unit's collectives: forward's gather and backward's
    assert long_steps["all_gather"] + long_steps["reduce_scatter"] == pytest.approx(
        share * gather + share * (gather + scatter)
    )
    # on a slow link the collectives outlast the compute
    slow = predict(profile, replace(hardware, link=CATALOGUE.link("pcie3")), SHARDED, 8, 1, "bf16-mixed")
    assert slow.breakdown["all_gather"] + slow.breakdown["reduce_scatter"] > 0.2 * slow.step_seconds


def test_each_shard_steps_its_part_of_the_optimizer():
    profile = builtin_profile("gpt2-1.5b")
    hardware = Hardware(CATALOGUE.gpu("h100-sxm"), CATALOGUE.link("nvlink4"))
    whole = predict(profile, hardware, UNSHARDED_PER_DEVICE, 8, 1).breakdown["optimizer"]
    sharded = predict(profile, hardware, SHARDED, 8, 1).breakdown["optimizer"]
    launches = max(1, profile.parameter_tensors) * CostConstants().launch_seconds / 4
    assert sharded - launches == pytest.approx((whole - launches) / 8)


def test_a_strategy_without_a_grad_scaler_cannot_run_16_mixed():
    profile = builtin_profile("resnet50")
    hardware = Hardware(CATALOGUE.gpu("a100-80gb-sxm"), CATALOGUE.link("nvlink3"))
    for name in available_strategies():
        prediction = predict(profile, hardware, name, 2 if name != "single" else 1, 32, "16-mixed")
        assert prediction.runs == strategy_class(name).traits.grad_scaler
        assert prediction.runs == (not any(note.startswith("cannot run") for note in prediction.notes))
        assert predict(profile, hardware, name, 1, 32, "bf16-mixed").runs


def test_smallest_fitting_devices_is_the_fewest_on_which_the_fullest_device_fits():
    profile = builtin_profile("llama-7b")
    hardware = Hardware(CATALOGUE.gpu("a100-80gb-sxm"), CATALOGUE.link("nvlink3"))
    sizing = Sizing(profile, hardware, 1, "bf16-mixed")
    usable = hardware.gpu.memory_bytes * CostConstants().memory_headroom
    by_hand = next(n for n in range(1, 65) if max(memory(profile, SHARDED, n, 1, "bf16-mixed")[0]) <= usable)
    assert 1 < by_hand < 8
    assert sizing.smallest_fitting_devices(SHARDED) == by_hand
    assert sizing.smallest_fitting_devices(UNSHARDED_PER_DEVICE) is None  # a whole copy never fits
    assert sizing.smallest_fitting_devices(SHARDED, most=by_hand - 1) is None
    # on two nodes the shards spread over both: half the devices per node
    two = Sizing(profile, replace(hardware, nodes=2, network=CATALOGUE.network("ib-200g")), 1, "bf16-mixed")
    assert two.smallest_fitting_devices(SHARDED) == -(-by_hand // 2)
    # a small model fits one device
    assert Sizing(builtin_profile("resnet50"), hardware, 32).smallest_fitting_devices(SHARDED) == 1
    # a given model without its units is planned as gathering the whole model at once
    given = given_profile(1e9)
    assert given.unit_parameters == given.parameters and given.units == 1
    assert given_profile(1e9, largest_unit_parameters=1e8).units == 10


def test_a_global_batch_is_split_and_the_fullest_share_sets_the_step():
    profile = builtin_profile("resnet50")
    hardware = Hardware(CATALOGUE.gpu("a100-80gb-sxm"), CATALOGUE.link("nvlink3"))
    batch = BatchSize(100, per_device=False)
    assert [batch.share(n) for n in (1, 3, 8, 100)] == [100, 34, 13, 1]
    assert batch.total(8) == 100 and BatchSize(8).total(4) == 32 and BatchSize(8).share(4) == 8
    planned = predict_all(profile, hardware, ["single", "ddp"], [1, 3, 8], batch)
    by_devices = {p.devices: p for p in planned if p.strategy == "ddp"}
    for devices, p in by_devices.items():
        # the fullest device's share: its step time and memory are those of that batch per device
        alone = predict(profile, hardware, "ddp", devices, -(-100 // devices))
        assert p.batch_per_device == -(-100 // devices) and p.batch == 100
        assert p.step_seconds == pytest.approx(alone.step_seconds)
        assert p.peak_bytes_per_device == alone.peak_bytes_per_device
        # but the step moves the global batch, not the share times the devices
        assert p.samples_per_second == pytest.approx(100 / p.step_seconds)
        assert p.to_dict()["batch_size"] == 100 and p.to_dict()["batch_size_per_device"] == p.batch_per_device
    # against one device running the whole batch
    single = next(p for p in planned if p.strategy == "single")
    assert (single.batch_per_device, single.speedup) == (100, pytest.approx(1.0))
    assert by_devices[8].speedup == pytest.approx(single.step_seconds / by_devices[8].step_seconds)
    # a plain number is a batch per device, as before
    per_device = predict_all(profile, hardware, ["ddp"], [8], 13)[0]
    assert per_device.batch == 104 and per_device.samples_per_second == pytest.approx(104 / per_device.step_seconds)
    with pytest.raises(ValueError, match="batch_size: 4 samples leave some of the 8 devices"):
        predict(profile, hardware, "ddp", 8, 1, global_batch=4)
    with pytest.raises(ValueError, match="batch_size: expected a positive number"):
        BatchSize(0, per_device=False)


def test_sizing_with_a_global_batch_shrinks_the_share_on_more_devices():
    profile = builtin_profile("llama-7b", seq_len=512)
    hardware = Hardware(CATALOGUE.gpu("a100-80gb-sxm"), CATALOGUE.link("nvlink3"))
    sizing = Sizing(profile, hardware, BatchSize(16, per_device=False), "bf16-mixed")
    assert [sizing.share(n) for n in (1, 4, 16)] == [16, 4, 1]
    for devices in (2, 4, 8):
        assert sizing.peak_bytes(SHARDED, devices) == max(
            memory(profile, SHARDED, devices, 16 // devices, "bf16-mixed")[0]
        )
    smallest = sizing.smallest_fitting_devices(SHARDED)
    assert sizing.fits(SHARDED, smallest) and not sizing.fits(SHARDED, smallest - 1)


def test_adamw_keeps_adams_state_and_decays_the_weights_in_one_more_pass():
    profile = builtin_profile("gpt2-124m")
    hardware = Hardware(CATALOGUE.gpu("h100-sxm"), CATALOGUE.link("nvlink4"))
    adam, adamw = (predict(profile, hardware, "ddp", 2, 8, optimizer=name) for name in ("adam", "adamw"))
    assert adam.peak_bytes_per_device == adamw.peak_bytes_per_device
    assert OPTIMIZER_STATE_BYTES_PER_PARAMETER["adamw"] == OPTIMIZER_STATE_BYTES_PER_PARAMETER["adam"]
    extra = adamw.breakdown["optimizer"] - adam.breakdown["optimizer"]
    assert extra == pytest.approx(8 * profile.parameters / hardware.gpu.memory_bytes_per_second)
