"""`--compress` in the cost model: the gradient exchange on the compressed bytes, PowerSGD's three collectives per
bucket, the compression's own work on the device, what a strategy takes, and PowerSGD's memory."""

from dataclasses import replace

import pytest
from torch import nn

from dpkit.plan.catalogue import GPU, Catalogue, Link
from dpkit.plan.compression_cost import gradient_matrices, powersgd_wire_bytes
from dpkit.plan.configuration import Hardware, Setup
from dpkit.plan.constants import CostConstants
from dpkit.plan.cost_model import predict, predict_all
from dpkit.plan.memory import memory_by_category
from dpkit.plan.profiles import ModelProfile, builtin_profile, given_profile, measure_model
from dpkit.strategies import matching
from dpkit.strategies.compression import parse_compression

CATALOGUE = Catalogue.load()
# whole gradients all-reduced among persistent processes (ddp), and the sharded-gradient strategies (fsdp, ...)
ALL_REDUCED = matching(lambda traits: "powersgd" in traits.compressions and traits.processes == "per-device")[0]
SHARDED_GRADIENTS = matching(lambda traits: traits.compressions == ("none", "bf16", "fp16"))
ONE_MATRIX = ModelProfile("one 4000 x 1000 matrix", 4_000_000, 1e3, 10, 1.0, 4.0, 4.0, 1,
                          weight_matrices=((4000, 1000, 1),))  # fmt: skip


def machine(latency_seconds=0.0, bytes_per_second=1e9, memory_bytes_per_second=1e12, flops=1e15):
    """Two nodes of one device each over a network with these figures: every collective crosses it."""
    gpu = GPU("test gpu", {p: flops for p in ("32", "tf32", "bf16-mixed", "16-mixed")}, 80 * 2**30,
              memory_bytes_per_second, "test", launch_seconds=0.0)  # fmt: skip
    fast = Link("fast", 1e21, 1e21, 0.0, "test")  # within a node: never the bound
    network = Link("network", bytes_per_second, bytes_per_second, latency_seconds, "test")
    return Hardware(gpu, fast, network, nodes=2)


def exposed(profile, hardware, strategy, compression, phase="all_reduce", **options):
    return predict(profile, hardware, strategy, 1, 1, options=options, compression=compression).breakdown.get(phase, 0)


def test_bf16_halves_the_all_reduce_and_powersgd_sends_its_factors():
    hardware = machine()  # no latency, compute too small to hide anything: the bytes alone
    whole = exposed(ONE_MATRIX, hardware, ALL_REDUCED, "none")
    assert whole > 0
    assert exposed(ONE_MATRIX, hardware, ALL_REDUCED, "bf16") == pytest.approx(whole / 2)
    # rank 4: P (4000 x 4) and Q (1000 x 4) instead of the 4000 x 1000 gradient
    factors = (4000 + 1000) * 4 / (4000 * 1000)
    assert exposed(ONE_MATRIX, hardware, ALL_REDUCED, "powersgd:4") == pytest.approx(whole * factors)
    assert exposed(ONE_MATRIX, hardware, ALL_REDUCED, "powersgd:1") == pytest.approx(whole * factors / 4)


def test_a_matrix_powersgd_would_not_shrink_twice_goes_whole():
    small = replace(ONE_MATRIX, parameters=100, weight_matrices=((10, 10, 1),))
    assert powersgd_wire_bytes(small, 4) == 400  # (10 + 10) x 4 x 2 > 100: sent as it is
    mixed = replace(ONE_MATRIX, parameters=4_000_000 + 500, weight_matrices=((4000, 1000, 1),))
    assert powersgd_wire_bytes(mixed, 2) == 4 * ((4000 + 1000) * 2 + 500)  # the 500 vector elements whole


def test_powersgd_takes_three_collectives_per_bucket():
    hardware = machine(latency_seconds=1e-3, bytes_per_second=1e18)  # latency alone
    whole = exposed(ONE_MATRIX, hardware, ALL_REDUCED, "none")
    assert exposed(ONE_MATRIX, hardware, ALL_REDUCED, "bf16") == pytest.approx(whole)
    assert exposed(ONE_MATRIX, hardware, ALL_REDUCED, "powersgd") == pytest.approx(3 * whole)


def test_the_compression_work_is_the_casts_or_powersgds_passes_on_the_device():
    memory_rate = 1e11
    hardware = machine(memory_bytes_per_second=memory_rate)
    elements = ONE_MATRIX.parameters
    work = exposed(ONE_MATRIX, hardware, ALL_REDUCED, "bf16", phase="compress")
    assert work == pytest.approx(16 * elements / memory_rate)  # cast down, divide, copy back
    # PowerSGD at low rank is memory-bound: 8 passes of error feedback, then each product reads or writes M once
    rank = 2
    product_bytes = 4 * (elements + (4000 + 1000) * rank)
    expected = (8 * 4 * elements + 3 * product_bytes) / memory_rate
    work = exposed(ONE_MATRIX, hardware, ALL_REDUCED, f"powersgd:{rank}", phase="compress")
    assert work == pytest.approx(expected, rel=1e-3)  # + the orthogonalizations' few FLOPs
    # at a slow arithmetic rate the three products are bound by their 2nmr FLOPs instead
    slow = machine(memory_bytes_per_second=memory_rate, flops=1e9)
    flops_rate = 1e9 * CostConstants().compute_efficiency
    work = exposed(ONE_MATRIX, slow, ALL_REDUCED, f"powersgd:{rank}", phase="compress")
    assert work >= 3 * 2 * elements * rank / flops_rate
    assert exposed(ONE_MATRIX, hardware, ALL_REDUCED, "none", phase="compress") == 0


def test_sharded_gradients_take_16_bits_on_their_reduce_scatter_and_refuse_powersgd():
    hardware, profile = machine(), ONE_MATRIX  # compute too small to hide anything
    assert SHARDED_GRADIENTS
    for strategy, options in [*((name, {}) for name in SHARDED_GRADIENTS), ("zero", {"stage": 2})]:
        whole = exposed(profile, hardware, strategy, "none", "reduce_scatter", **options)
        assert exposed(profile, hardware, strategy, "bf16", "reduce_scatter", **options) == pytest.approx(whole / 2)
        refused = f"compress: strategy '{strategy}' takes none, bf16, fp16; got 'powersgd:2'"
        with pytest.raises(ValueError, match=refused):
            predict(profile, hardware, strategy, 1, 1, options=options, compression="powersgd")


def test_zero_stage_1_under_powersgd_all_reduces_as_ddp_does():
    hardware = machine()
    one = predict(ONE_MATRIX, hardware, "zero", 1, 1, options={"stage": 1}, compression="powersgd:4")
    ddp = predict(ONE_MATRIX, hardware, ALL_REDUCED, 1, 1, compression="powersgd:4")
    assert "reduce_scatter" not in one.breakdown
    assert one.breakdown["all_reduce"] == pytest.approx(ddp.breakdown["all_reduce"])
    assert one.breakdown["all_gather"] > 0  # the updated weights, which no gradient compression shrinks


def test_a_plan_predicts_the_strategies_that_do_not_take_it_uncompressed_with_a_note():
    hardware = Hardware(CATALOGUE.gpu("h100-sxm"), CATALOGUE.link("nvlink4"))
    profile = builtin_profile("gpt2-124m")
    predictions = predict_all(profile, hardware, ["single", "dp", "ddp", "fsdp"], [1, 2], 4, compression="powersgd")
    by_name = {(p.strategy, p.devices): p for p in predictions}
    assert by_name["ddp", 2].compress == "powersgd:2" and by_name["fsdp", 2].compress == "none"
    assert by_name["dp", 2].compress == "none" and by_name["single", 1].compress == "none"
    assert any("takes no powersgd:2: predicted uncompressed" in note for note in by_name["fsdp", 2].notes)
    assert not by_name["ddp", 2].notes and not by_name["single", 1].notes  # one device: nothing to compress
    plain = predict_all(profile, hardware, ["fsdp"], [2], 4)[-1]
    assert plain.step_seconds == by_name["fsdp", 2].step_seconds


def test_powersgd_keeps_an_error_feedback_copy_of_the_gradients():
    hardware = Hardware(CATALOGUE.gpu("h100-sxm"), CATALOGUE.link("nvlink4"))
    profile = builtin_profile("gpt2-124m")

    def state(compression, devices=2):
        setup = Setup(profile, hardware, ALL_REDUCED, devices, 4, compression=parse_compression(compression))
        return memory_by_category(setup)[0]["compression_state"]

    bucket = CostConstants().bucket_bytes
    assert state("powersgd:4") == 4 * profile.parameters + bucket
    assert state("none") == state("bf16") == state("powersgd", devices=1) == 0


class ConvThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)  # 8 x (3 x 3 x 3), as PowerSGD views it
        self.first = nn.Linear(8 * 4 * 4, 20)
        self.second = nn.Linear(20, 20)
        self.third = nn.Linear(20, 20, bias=False)

    def forward(self, x):
        return self.third(self.second(self.first(self.conv(x).flatten(1))))


def test_a_measured_model_carries_its_weight_matrices_through_json():
    profile = measure_model(ConvThenLinear, (3, 6, 6))
    assert profile.weight_matrices == ((8, 27, 1), (20, 20, 2), (20, 128, 1))
    assert ModelProfile.from_dict(profile.to_dict()) == profile


def test_without_shapes_the_parameters_are_shared_by_square_matrices():
    given = given_profile(1e8)
    ((side, columns, count),) = gradient_matrices(given)
    assert (side, columns, count) == (10_000, 10_000, 1)  # one unit: the whole model
    counted = replace(given, parameter_tensors=200)
    ((side, columns, count),) = gradient_matrices(counted)
    assert count == 100 and side == columns == 1000  # a matrix per weight-and-bias pair
    gpt2 = builtin_profile("gpt2-124m")  # its architecture's own
    assert (768, 3 * 768, 12) in gpt2.weight_matrices
    assert sum(r * c * n for r, c, n in gpt2.weight_matrices) == pytest.approx(gpt2.parameters, rel=0.01)
