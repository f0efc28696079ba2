"""Every strategy resumes a whole state and a sharded one, with every optimizer `dpkit train` offers (issue 43).

The matrix: single, dp, replicated (one process), ddp, fsdp, zero stage 1 and 2, hsdp 1-D (two processes) and hsdp
2x2 (four: another world size than the states were saved on); plain SGD (no per-parameter state: torch's
distributing load once asserted "Expected device to be set"), SGD with momentum, and AdamW with a cosine schedule
made after the load as the recipe makes it (the saved groups hold `initial_lr`, which once failed the load). Each
resumes from step 3 of a state saved by one device (whole) and of one saved by fsdp on two processes (sharded),
trains to step 6 (the sharded state with AdamW and its schedule, the whole one with every optimizer; hsdp 2x2 both
with AdamW), and ends where one device trained 6 steps without a stop ends. The processes are the suite's
shared launched groups: each group runs its whole column in one job.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from closeness import difference_to_scale
from dpkit.engine.engine import Engine
from dpkit.recipe.optimization import build_optimizer, schedule_at

STEPS, SAVED_AT = 6, 3
TOLERANCE = 1e-5  # relative to the largest weight: layouts sum the rows in different orders
# optimizer, momentum, schedule (lr 0.2 for sgd, 0.01 for adamw)
OPTIMIZERS = [("sgd", 0.0, "constant"), ("sgd", 0.9, "constant"), ("adamw", 0.0, "cosine")]
# a sharded state is resumed with the optimizer whose state it shards per parameter, with its schedule (the whole
# state with all three: plain SGD, whose state has no tensors, once failed only there)
SHARDED_WITH = OPTIMIZERS[2]
IN_ONE_PROCESS = [("single", 1, {}), ("dp", 2, {}), ("replicated", 2, {})]
IN_TWO = [("ddp", 2, {}), ("fsdp", 2, {}), ("zero", 2, {"stage": 1}), ("zero", 2, {"stage": 2}), ("hsdp", 2, {})]
IN_FOUR = [("hsdp", 4, {"shard_size": 2})]


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(4)
    return TensorDataset(torch.randn(96, 10, generator=generator), torch.randint(0, 3, (96,), generator=generator))


def train(layout: tuple, optimizer: tuple, until: int, resume_from: str | None = None, save_to: str | None = None):
    """Train under `layout` to step `until`, resuming from `resume_from` and saving at SAVED_AT into `save_to`;
    the whole weights."""
    strategy, devices, options = layout
    name, momentum, schedule = optimizer
    lr = 0.2 if name == "sgd" else 0.01
    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False, **options)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
    base = build_optimizer(name, model.parameters(), lr, momentum, 0.0)
    model, engine_optimizer = engine.setup(model, base)
    loader = engine.setup_dataloader(DataLoader(data(), batch_size=16))
    if resume_from is not None:
        engine.load_state(resume_from)
    rates = schedule_at(base, lr, schedule, STEPS, 0, engine.step)  # after the load, as the recipe makes it
    while engine.step < until:
        for x, y in loader:
            engine_optimizer.zero_grad()
            engine.backward(nn.functional.cross_entropy(model(x), y))
            engine_optimizer.step()
            rates.step()
            if engine.step == SAVED_AT and save_to is not None:
                engine.save_state(save_to)
            if engine.step == until:
                break
    weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in model.state_dict().items()}
    engine.close()
    return weights


def column(layouts: list, sources: dict[str, str]) -> dict[str, dict]:
    """Every layout x optimizer x source resumed to STEPS (a load writes nothing: the sources are shared): the
    weights by 'strategy options optimizer momentum source'."""
    results = {}
    for layout in layouts:
        for optimizer in OPTIMIZERS:
            for source, saved in sources.items():
                if source == "sharded" and optimizer != SHARDED_WITH:
                    continue
                if layout[1] == 4 and optimizer != SHARDED_WITH:  # (four processes on two cores: the hardest case)
                    continue
                key = f"{layout[0]} {layout[2]} {optimizer[0]} {optimizer[1]} {source}"
                results[key] = train(layout, optimizer, STEPS, resume_from=f"{saved}/{optimizer[0]}-{optimizer[1]}")
    return results


def save_sharded(folder: str) -> None:
    """In each of two processes: fsdp's state at SAVED_AT, with AdamW (per-parameter state in shards)."""
    optimizer = SHARDED_WITH
    train(("fsdp", 2, {}), optimizer, SAVED_AT, save_to=f"{folder}/{optimizer[0]}-{optimizer[1]}")


def test_every_strategy_resumes_a_whole_and_a_sharded_state_with_every_optimizer(tmp_path, groups):
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    uninterrupted = {}
    for optimizer in OPTIMIZERS:
        uninterrupted[optimizer[:2]] = train(("single", 1, {}), optimizer, STEPS)
        train(("single", 1, {}), optimizer, SAVED_AT, save_to=str(whole / f"{optimizer[0]}-{optimizer[1]}"))
    groups(2).run(save_sharded, str(sharded))
    sources = {"whole": str(whole), "sharded": str(sharded)}
    results = [column(IN_ONE_PROCESS, sources)]
    results += groups(2).run(column, IN_TWO, sources)
    results += groups(4).run(column, IN_FOUR, sources)
    differences = {}
    for process, resumed in enumerate(results):
        for key, weights in resumed.items():
            name, momentum = key.split(" ")[-3], float(key.split(" ")[-2])
            reference = uninterrupted[(name, momentum)]
            differences[f"{key} (process {process})"] = max(
                difference_to_scale(weights[k], reference[k]) for k in reference
            )
    expected = (len(IN_ONE_PROCESS) + 2 * len(IN_TWO)) * (len(OPTIMIZERS) + 1) + 4 * len(IN_FOUR) * 2
    assert len(differences) == expected
    worst = {key: value for key, value in differences.items() if value > TOLERANCE}
    assert not worst, worst
