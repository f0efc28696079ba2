"""When one ddp process dies, the launcher stops the others and says which worker failed, quickly."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

WORKER = textwrap.dedent("""
    import os
    import torch
    from dpkit.engine import Engine

    engine = Engine(strategy="ddp", accelerator="cpu", devices=2, timeout_seconds=30)
    model = torch.nn.Linear(16, 1)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    for step in range(100_000):
        if engine.rank == 1 and step == 5:
            os._exit(7)  # a crash: no exception, no clean shutdown
        optimizer.zero_grad()
        engine.backward(model(torch.randn(8, 16)).pow(2).mean())
        optimizer.step()
    print("rank", engine.rank, "finished without noticing the failure")
""")


def test_a_dead_process_stops_the_others_with_a_clear_error(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(WORKER)
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "dpkit.cli.main", "launch", "--nproc-per-node", "2", str(script)],
                            capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - began
    assert result.returncode != 0
    assert "finished without noticing" not in result.stdout
    assert "dpkit launch: error: worker rank 1" in result.stderr, result.stderr[-3000:]
    assert "exited with code 7" in result.stderr
    assert elapsed < 60, f"took {elapsed:.1f} s to stop"
