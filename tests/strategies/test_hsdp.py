"""hsdp: FSDP2 over a 2-D mesh (replicate x shard) of 4 processes equals one device (uneven batches, SGD with
clipping, Adam, accumulation), resumes exactly, and to another mesh shape, and each process keeps the shards of
its group, as the planner predicts from its traits."""

from __future__ import annotations

import pytest
import torch
from fsdp_runs import RunSpec, launched_runs, train
from sharding_runs import STATE, observed_many, predicted

from closeness import difference_to_scale
from dpkit.strategies import ONE_NODE, create_strategy, strategy_traits

# relative to the largest weight (tests/closeness.py): the runs sum in different orders. Adam divides each gradient by
# its running size, so a rounding apart in a small gradient moves a weight by a share of the learning rate, not of
# the weight: measured up to 2e-5 of the largest weight (0.26 in these models) after 4 steps with AVX-512, AVX2 or
# plain kernels; SGD's runs stay below 1e-6
TOLERANCE = {"sgd": 1e-5, "adam": 1e-4}
SPECS = [  # 3 steps each: 4 processes share 2 cores in the tests
    RunSpec(batch_size=67, optimizer="sgd", clip=0.5, steps=3),  # 17 + 17 + 17 + 16 rows on 4 processes
    RunSpec(batch_size=33, optimizer="adam", accumulate=2, steps=3),  # micro-batches of 9 + 8 + 8 + 8 rows
]


def hsdp(spec: RunSpec, shard_size: int, **changes) -> RunSpec:
    options = {"shard_size": shard_size}
    return RunSpec(**{**spec.__dict__, "strategy": "hsdp", "devices": 4, "options": options, **changes})


def test_on_a_2_by_2_mesh_it_equals_one_device_with_sgd_adam_uneven_batches_accumulation_and_clipping(groups):
    singles = [train(spec) for spec in SPECS]
    assert singles[0]["norms"] and min(singles[0]["norms"]) > 0.5  # the clip acts on every step
    for rank, results in enumerate(launched_runs([hsdp(spec, 2) for spec in SPECS], 4, groups)):
        for spec, result, single in zip(SPECS, results, singles):
            where = f"rank {rank}, {spec}"
            assert difference_to_scale(result["weights"], single["weights"]) <= TOLERANCE[spec.optimizer], where
            assert result["norms"] == pytest.approx(single["norms"], rel=1e-5), where


def test_the_shard_group_is_one_node_or_shard_size_processes(monkeypatch):
    assert strategy_traits("hsdp").shard_group == ONE_NODE
    traits = strategy_traits("hsdp", shard_size=2)
    assert traits.shard_size(8, per_node=4) == 2 and traits.sharded_parts == ("weights", "gradients", "optimizer_state")
    assert strategy_traits("hsdp").shard_size(8, per_node=4) == 4  # a node's processes
    with pytest.raises(ValueError, match=r"shard_size: expected a positive int .*, got 0"):
        strategy_traits("hsdp", shard_size=0)
    variables = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}
    for variable, value in {**variables, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(variable, value)
    devices = [torch.device("cpu", index) for index in range(4)]
    with pytest.raises(ValueError, match="shard_size: 3 processes per shard group do not divide the 4 processes"):
        create_strategy("hsdp", devices, shard_size=3)
    assert create_strategy("hsdp", devices, shard_size=2).mesh_shape == (2, 2)
    assert create_strategy("hsdp", devices).mesh_shape == (1, 4)  # one node: shard over all of it


def test_it_resumes_bitwise_and_on_other_mesh_shapes(tmp_path, groups):
    state = str(tmp_path / "state")
    adam = {"optimizer": "adam", "batch_size": 67}
    runs = [
        hsdp(RunSpec(**adam, steps=6), 2),
        hsdp(RunSpec(**adam, steps=3, save_at=3, state=state), 2),
        hsdp(RunSpec(**adam, steps=6, resume=True, state=state), 2),
        hsdp(RunSpec(**adam, steps=6, resume=True, state=state), 4),  # 1 x 4
        hsdp(RunSpec(**adam, steps=6, resume=True, state=state), 1),  # 4 x 1
    ]
    for results in launched_runs(runs, 4, groups):
        whole, _, resumed, *other_meshes = results
        assert all(torch.equal(resumed["weights"][k], whole["weights"][k]) for k in whole["weights"])
        for result in other_meshes:  # another mesh reduces in another order: the last bits may differ
            assert difference_to_scale(result["weights"], whole["weights"]) <= 1e-6
    # fsdp and one device read the 2 x 2 shards too
    on_fsdp = launched_runs([RunSpec(**adam, strategy="fsdp", devices=4, steps=6, resume=True, state=state)], 4, groups)
    alone = train(RunSpec(**adam, steps=6, resume=True, state=state))
    for result in (on_fsdp[0][0], alone):
        assert difference_to_scale(result["weights"], whole["weights"]) <= TOLERANCE["adam"]


def test_each_process_keeps_its_groups_shards_as_the_planner_predicts(groups):
    """Weights + gradients + optimizer state kept between steps, as `dpkit profile` books them, within 15% of the
    planner's prediction: 16Ψ/S for a shard group of S processes, whatever the number of groups."""
    runs = [("hsdp", 4, {"shard_size": 2}), ("hsdp", 4, {"shard_size": 4})]
    results = groups(4).run(observed_many, runs)
    for rank, measured in enumerate(results):
        for run, books in zip(runs, measured):
            prediction = predicted(*run)
            kept, expected = sum(books["kept"].values()), sum(prediction[name] for name in STATE)
            assert abs(kept / expected - 1) <= 0.15, (rank, run, books["kept"], prediction)
        two_by_two, one_by_four = measured
        assert two_by_two["mesh"] == (2, 2) and two_by_two["placements"] == ["Replicate", "Shard"]
        assert one_by_four["mesh"] == (4,) and one_by_four["placements"] == ["Shard"]
        # half the state in a group of 2, a quarter in a group of 4
        ratio = sum(two_by_two["kept"].values()) / sum(one_by_four["kept"].values())
        assert 1.8 < ratio < 2.2, ratio
