"""When one ddp process dies, the launcher stops the others and says which worker failed, quickly."""

from __future__ import annotations

import json
import os
import textwrap
import time

import torch

from closeness import difference_to_scale
from dpkit.cli.main import main

WORKER = textwrap.dedent("""
    import os
    import torch

    from dpkit.engine.engine import Engine

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


def test_a_dead_process_stops_the_others_with_a_clear_error(tmp_path, capfd):
    script = tmp_path / "dies.py"
    script.write_text(WORKER)
    began = time.monotonic()
    # `dpkit launch` in this process (the workers are the processes that matter; a launcher process more would
    # only import torch again)
    code = main(["launch", "--nproc-per-node", "2", str(script)])
    elapsed = time.monotonic() - began
    stdout, stderr = capfd.readouterr()
    assert code != 0
    assert "finished without noticing" not in stdout
    assert "dpkit launch: error: worker rank 1" in stderr, stderr[-3000:]
    assert "exited with code 7" in stderr
    assert elapsed < 60, f"took {elapsed:.1f} s to stop"


KILLED_ONCE = textwrap.dedent("""
    import os, signal
    from torch import nn

    class DiesOnce(nn.Sequential):
        \"\"\"The digits MLP; on the first attempt, rank 1 is SIGKILLed in its 6th training forward.\"\"\"

        forwards = 0

        def forward(self, x):
            if self.training:
                DiesOnce.forwards += 1
                if (os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
                        and DiesOnce.forwards == 6):
                    os.kill(os.getpid(), signal.SIGKILL)
            return super().forward(x)

    def build():
        return DiesOnce(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
""")


def test_a_worker_killed_mid_run_restarts_resumes_and_ends_with_the_uninterrupted_weights(tmp_path, monkeypatch, capfd):
    (tmp_path / "dies_once.py").write_text(KILLED_ONCE)
    monkeypatch.syspath_prepend(str(tmp_path))  # dies_once:build, here and in the workers
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    flags = [
        "--model",
        "dies_once:build",
        "--accelerator",
        "cpu",
        "--steps",
        "9",
        "--batch-size",
        "50",
        "--momentum",
        "0.9",
        "--seed",
        "2",
        "--no-progress",
    ]
    # `dpkit launch` in this process, its workers running `python -m dpkit.cli.main train`
    code = main(
        [
            "launch",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "-m",
            "dpkit.cli.main",
            "train",
            "--strategy",
            "ddp",
            "--devices",
            "2",
            "--checkpoint-every",
            "2",
            "--sync-checkpoints",  # (step 4 whole before step 6 dies: a background save may still be in flight)
            "--out",
            str(tmp_path / "restarted"),
            *flags,
        ]
    )
    stdout, stderr = capfd.readouterr()
    assert code == 0, stderr[-3000:]
    # the group restarted from the state of step 4 (rank 1 died in step 6) and finished the 9 steps
    assert "resuming at step 4" in stdout, stdout
    metrics = json.loads((tmp_path / "restarted" / "metrics.json").read_text())
    assert metrics["resumed"] is True and len(metrics["loss"]) == 9

    assert main(["train", "--strategy", "single", "--out", str(tmp_path / "whole"), *flags]) == 0
    restarted = torch.load(tmp_path / "restarted" / "model.pt", weights_only=True)
    whole = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    # ddp against one device: equal up to float rounding of the gradient all-reduce (as the equivalence tests),
    # relative to the values' size (tests/closeness.py)
    assert difference_to_scale(restarted, whole) <= 1e-5
    whole_losses = json.loads((tmp_path / "whole" / "metrics.json").read_text())["loss"]
    losses = torch.tensor(metrics["loss"], dtype=torch.float64)
    assert difference_to_scale(losses, torch.tensor(whole_losses, dtype=torch.float64)) <= 1e-5
