"""What ddp and fsdp share: a process may close its Engine and make another, which joins a fresh group."""

from __future__ import annotations

from dpkit.engine.engine import Engine


def again_and_again() -> list[float]:
    sums = []
    for round, strategy in enumerate(["ddp", "fsdp", "ddp", "fsdp", "ddp", "fsdp"]):
        engine = Engine(strategy=strategy, accelerator="cpu", devices=2, progress=False)
        sums.append(float(engine.reduce(float(engine.rank + round), "sum")))
        engine.close()
    return sums


def test_an_engine_made_after_another_closed_joins_a_fresh_process_group(groups):
    # each group's rendezvous keys are its own: gloo would otherwise connect to a closed group's addresses
    for sums in groups(2).run(again_and_again):
        assert sums == [1.0 + 2 * round for round in range(6)]
