import re

import pytest
import torch

from dpkit.cli.main import main
from dpkit.examples.digits import DigitsMLP


def test_demo_trains_reports_and_saves_a_clean_checkpoint(tmp_path, capsys):
    code = main(
        ["demo", "--accelerator", "cpu", "--devices", "2", "--epochs", "20", "--out", str(tmp_path), "--no-progress"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    accuracy = float(re.search(r"held-out accuracy: ([0-9.]+)", out).group(1))
    assert accuracy >= 0.95
    rows = [int(n) for n in re.findall(r"cpu:\d\s+(\d+)", out)]
    assert len(rows) == 2 and abs(rows[0] - rows[1]) <= 20 * 23  # balanced: at most one row apart per step
    assert "time per step" in out
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    DigitsMLP().load_state_dict(state)  # strict: clean keys
    # the lesson's end: the same model under dp and ddp, each device's peak and the step, measured here
    ending = out[out.index("the lesson's end") :].splitlines()
    header = ending.index("  strategy   cpu:0 MiB  cpu:1 MiB   step ms")
    dp, ddp = (ending[header + 1].split(), ending[header + 2].split())
    assert dp[0] == "dp" and ddp[0] == "ddp"
    assert float(dp[1]) > 1.5 * float(dp[2])  # dp's first device carries the optimizer state and the sum
    # ddp: every device the same model, gradients and optimizer state; what its gradient buckets hold at a rank's
    # peak depends on when their all-reduces complete (0.61 to 0.71 MiB on a busy machine), never dp's lopsidedness
    peaks = [float(ddp[1]), float(ddp[2])]
    assert max(peaks) < 1.5 * min(peaks) and min(peaks) > float(dp[2])
    assert float(dp[3]) > 0 and float(ddp[3]) > 0
    said = " ".join(ending[header + 3 :])
    ratio = float(re.search(r"here ddp's step took ([0-9.]+)x dp's", said).group(1))
    assert ratio == pytest.approx(float(ddp[3]) / float(dp[3]), rel=0.02)  # (from the rounded table)
    assert "prefer it when dp's first device runs out of memory, on many GPUs and across machines" in said
    assert "`dpkit profile --model pkg.module:factory --strategies dp,ddp`" in said and "`dpkit plan --model" in said


def test_demo_rejects_bad_arguments(capsys):
    assert main(["demo", "--epochs", "0", "--accelerator", "cpu"]) == 2
    assert "--epochs" in capsys.readouterr().err
