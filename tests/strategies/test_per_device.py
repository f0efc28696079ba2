"""What ddp and fsdp share: a process may close its Engine and make another, which joins a fresh group."""

from __future__ import annotations

import textwrap

from dpkit.launch import launch

AGAIN_AND_AGAIN = textwrap.dedent("""
    import os, sys
    import torch
    from dpkit.training.engine import Engine

    sums = []
    for round, strategy in enumerate(["ddp", "fsdp", "ddp", "fsdp", "ddp", "fsdp"]):
        engine = Engine(strategy=strategy, accelerator="cpu", devices=2, progress=False)
        sums.append(float(engine.reduce(float(engine.rank + round), "sum")))
        engine.close()
    with open(sys.argv[1] + os.environ["RANK"], "w") as out:
        out.write(repr(sums))
""")


def test_an_engine_made_after_another_closed_joins_a_fresh_process_group(tmp_path):
    # each group's rendezvous keys are its own: gloo would otherwise connect to a closed group's addresses
    script = tmp_path / "again.py"
    script.write_text(AGAIN_AND_AGAIN)
    launch(str(script), nproc_per_node=2, script_args=[str(tmp_path / "sums-")])
    for rank in range(2):
        assert (tmp_path / f"sums-{rank}").read_text() == repr([1.0 + 2 * round for round in range(6)])
