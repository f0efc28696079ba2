import re

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


def test_demo_rejects_bad_arguments(capsys):
    assert main(["demo", "--epochs", "0", "--accelerator", "cpu"]) == 2
    assert "--epochs" in capsys.readouterr().err
