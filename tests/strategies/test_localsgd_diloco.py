"""localsgd and diloco (issue 47), in the suite's shared launched groups: with H=1, plain SGD and uneven shares
localsgd is the single device's step, and diloco with outer_lr=1, outer_momentum=0 is localsgd; a state saved
mid-period resumes bit for bit (the replicas' own weights and optimizers, the anchor, the outer momentum); the
meetings carry H times fewer bytes than ddp's every-step exchange, compressed as compress= says; the replicas'
spread is measured at each meeting."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from closeness import difference_to_scale
from dpkit.engine.engine import Engine

STEPS = 6


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(90, 6, generator=generator), torch.randint(0, 3, (90,), generator=generator))


def train(
    strategy: str,
    devices: int,
    options: dict | None = None,
    momentum: float = 0.0,
    steps: int = STEPS,
    resume: str | None = None,
    save_at: tuple[int, str] | None = None,
) -> dict:
    from dpkit.observe.collectives import RECORD

    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False, **(options or {}))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    model, optimizer = engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.4, momentum=momentum))
    loader = engine.setup_dataloader(DataLoader(data(), batch_size=15))  # 8 + 7 rows: uneven shares
    if resume is not None:
        engine.load_state(resume)
    sent = RECORD.gradient_bytes
    while engine.step < steps:
        for x, y in loader:
            optimizer.zero_grad()
            engine.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            if save_at is not None and engine.step == save_at[0]:
                engine.save_state(save_at[1])
            if engine.step == steps:
                break
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result = {"weights": weights, "bytes": RECORD.gradient_bytes - sent, **engine.strategy.run_metrics()}
    engine.close()
    return result


def test_one_step_periods_are_the_single_device_step_and_diloco_at_lr_1_is_localsgd(groups):
    single = train("single", 1)["weights"]
    local = groups(2).run(train, "localsgd", 2, {"sync_every": 1})
    outer = groups(2).run(train, "diloco", 2, {"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0})
    for result in (*local, *outer):
        assert difference_to_scale(result["weights"], single) <= 1e-5
    assert all(torch.equal(outer[0]["weights"][k], local[0]["weights"][k]) for k in single)
    longer = groups(2).run(train, "localsgd", 2, {"sync_every": 3})[0]
    assert difference_to_scale(longer["weights"], single) > 1e-3  # H > 1 changes the optimization
    assert len(longer["parameter_spread"]) == STEPS // 3 and all(s > 0 for s in longer["parameter_spread"])


@pytest.mark.parametrize("strategy", ["diloco"])  # (localsgd's state is diloco's without the outer momentum)
def test_a_state_saved_mid_period_resumes_bit_for_bit(strategy, tmp_path, groups):
    options = {"sync_every": 4}
    whole = groups(2).run(train, strategy, 2, options, momentum=0.9)
    folder = str(tmp_path / "state")
    groups(2).run(train, strategy, 2, options, momentum=0.9, steps=3, save_at=(3, folder))  # 3 of a 4-step period
    resumed = groups(2).run(train, strategy, 2, options, momentum=0.9, resume=folder)
    for rank in range(2):  # each replica's own weights (mid-period they differ) came back with its state
        assert all(torch.equal(resumed[rank]["weights"][k], whole[rank]["weights"][k]) for k in whole[rank]["weights"])
    assert resumed[0]["parameter_spread"] == whole[0]["parameter_spread"]


def test_meetings_send_h_times_fewer_bytes_and_take_compression(groups):
    every_step = groups(2).run(train, "ddp", 2)[0]["bytes"]
    every_third = groups(2).run(train, "localsgd", 2, {"sync_every": 3})[0]["bytes"]
    in_bf16 = groups(2).run(train, "localsgd", 2, {"sync_every": 3, "compress": "bf16"})[0]["bytes"]
    assert every_third < every_step / 2.5  # the moves' all-reduce every third step, and its small companions
    assert in_bf16 < every_third * 0.6


def test_the_meeting_settings_are_checked_before_anything_starts(tmp_path, capsys):
    from dpkit.cli.main import main as dpkit_main

    cpu = ["train", "--accelerator", "cpu", "--devices", "2", "--no-progress", "--out", str(tmp_path / "run")]
    for flags, said in (
        (["--strategy", "localsgd", "--sync-every", "0"], "--sync-every: expected a positive int, got 0"),
        (["--strategy", "ddp", "--sync-every", "4"], "--sync-every: strategy 'ddp' has no sync every"),
        (["--strategy", "diloco", "--outer-lr", "-1"], "--outer-lr: expected a finite number > 0, got -1.0"),
    ):
        assert dpkit_main([*cpu, *flags]) == 2
        assert said in capsys.readouterr().err
        assert not (tmp_path / "run").exists()


def train_without_the_engines_loader() -> float:
    """In each process: four steps on tensors fed straight to the model (no engine.setup_dataloader), meeting at the
    fourth; how far the weights moved from where they started."""
    engine = Engine(strategy="localsgd", accelerator="cpu", devices=2, progress=False, sync_every=4)
    torch.manual_seed(0)
    net = nn.Linear(8, 1)
    before = [p.detach().clone() for p in net.parameters()]
    model, optimizer = engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(engine.rank)
    x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 1, generator=generator)
    for _ in range(4):
        optimizer.zero_grad()
        engine.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(net.parameters(), before))
    engine.close()
    return moved


def test_a_loop_without_the_engines_loader_meets_with_equal_weights(groups):
    """It counted no rows: the meeting once weighted every replica by zero and threw the period's training away."""
    assert all(moved > 0.05 for moved in groups(2).run(train_without_the_engines_loader))
