"""compress= under every strategy that moves gradients (issue 44), in the suite's shared launched groups.

Each strategy trains the same model from the same weights on the same global batches; compressed, it ends near
one device's float32 result (within what the format loses) and not on it; ddp and replicated, which run the same
arithmetic over processes and over replicas, end together; PowerSGD's state resumes bit for bit; the record counts
the bytes that crossed; accumulation does no compression work on the micro-batches that do not synchronize.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from closeness import difference_to_scale
from dpkit.engine.engine import Engine
from dpkit.strategies.compression import compressed_bytes, parse_compression

STEPS = 6
SIXTEEN_BIT_LOSS = 4e-3  # measured 9e-4 after 8 steps of this model at bf16 (its unit in the last place is 4e-3)


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(96, 32, generator=generator), torch.randint(0, 4, (96,), generator=generator))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))


def train(
    strategy: str,
    devices: int,
    compress: str = "none",
    steps: int = STEPS,
    options: dict | None = None,
    resume: str | None = None,
    save_at: tuple[int, str] | None = None,
    accumulate: int = 1,
) -> dict:
    """The weights after `steps` (and what the record counted), optionally resumed or saving on the way."""
    from dpkit.observe.collectives import RECORD

    engine = Engine(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        progress=False,
        compress=compress,
        compress_warmup_steps=2 if compress.startswith("powersgd") else None,
        accumulate=accumulate,
        **(options or {}),
    )
    net = model()
    wrapped, optimizer = engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.3, momentum=0.5))
    loader = engine.setup_dataloader(DataLoader(data(), batch_size=16 // accumulate))
    if resume is not None:
        engine.load_state(resume)
    gradient_bytes = RECORD.gradient_bytes
    entries_before = RECORD.sequence
    saved = False
    while engine.step < steps:
        for x, y in loader:
            optimizer.zero_grad()
            engine.backward(nn.functional.cross_entropy(wrapped(x), y))
            optimizer.step()
            if save_at is not None and engine.step == save_at[0] and not saved:
                engine.save_state(save_at[1])
                saved = True
            if engine.step == steps:
                break
    weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in wrapped.state_dict().items()}
    compressed_entries = sum(1 for e in RECORD.since(entries_before) if e.op.endswith(f"({compress})"))
    counted = {"gradient_bytes": RECORD.gradient_bytes - gradient_bytes, "compressed_entries": compressed_entries}
    engine.close()
    return {"weights": weights, **counted}


def test_sixteen_bits_under_each_exchange_end_near_float32_and_agree_where_the_arithmetic_is_the_same(groups):
    single = train("single", 1)["weights"]
    results = {
        "replicated": train("replicated", 2, "bf16")["weights"],
        "replicated none": train("replicated", 2)["weights"],
    }
    # (zero stage 1 runs ddp's exchange, hsdp on 2 processes fsdp's: tests/recipe and benchmarks cover them)
    for strategy, options in (("ddp", {}), ("zero", {"stage": 2}), ("fsdp", {})):
        results[f"{strategy} {options}"] = groups(2).run(train, strategy, 2, "bf16", options=options)[0]["weights"]
    for name, weights in results.items():
        difference = difference_to_scale(weights, single)
        if name.endswith("none"):
            assert difference <= 1e-5, (name, difference)
        else:
            assert 1e-6 < difference <= SIXTEEN_BIT_LOSS, (name, difference)  # compressed, and no more than bf16 loses
    assert difference_to_scale(results["ddp {}"], results["replicated"]) <= 1e-5


def test_powersgd_over_processes_and_over_replicas_is_one_arithmetic_and_resumes_bit_for_bit(tmp_path, groups):
    replicated = train("replicated", 2, "powersgd:1")["weights"]
    single = train("single", 1)["weights"]
    whole = groups(2).run(train, "ddp", 2, "powersgd:1")[0]["weights"]
    assert difference_to_scale(whole, replicated) <= 1e-5
    assert difference_to_scale(whole, single) > 1e-3  # rank 1 after warm-up: a different path than float32's
    folder = str(tmp_path / "state")
    groups(2).run(train, "ddp", 2, "powersgd:1", steps=4, save_at=(4, folder))
    resumed = groups(2).run(train, "ddp", 2, "powersgd:1", resume=folder)[0]["weights"]
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)  # error feedback and Q came back with the state
    replicated_state = str(tmp_path / "replicated-state")
    train("replicated", 2, "powersgd:1", steps=4, save_at=(4, replicated_state))
    again = train("replicated", 2, "powersgd:1", resume=replicated_state)["weights"]
    assert all(torch.equal(again[k], replicated[k]) for k in replicated)


def test_the_record_counts_what_crossed_and_accumulation_compresses_only_the_synchronizing_micro_batch(groups):
    shapes = [tuple(p.shape) for p in model().parameters()]
    sent = {}
    for compress in ("none", "bf16", "powersgd:1"):
        sent[compress] = groups(2).run(train, "ddp", 2, compress, accumulate=2)[0]
    floats = compressed_bytes(shapes, parse_compression("none"))
    assert sent["none"]["gradient_bytes"] == STEPS * floats
    assert sent["bf16"]["gradient_bytes"] == STEPS * floats // 2
    assert sent["bf16"]["compressed_entries"] == STEPS  # one bucket per step: the micro-batch in between sent none
    powersgd = compressed_bytes(shapes, parse_compression("powersgd:1"))
    # (the step marks' own all-reduce is not the gradients')
    assert sent["powersgd:1"]["gradient_bytes"] == 2 * floats + (STEPS - 2) * powersgd
