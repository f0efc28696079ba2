"""The demo's hint for loading its checkpoint is a snippet that runs as printed."""

import textwrap

import torch

from dpkit.examples.digits import DigitsMLP
from dpkit.tools.demo import demo

HINT = "load it into a bare model with:"


def test_the_load_hint_runs_as_printed(tmp_path, capsys, monkeypatch):
    assert demo(accelerator="cpu", devices=2, epochs=1, out=str(tmp_path / "demo"), progress=False, compare=False)
    lines = capsys.readouterr().out.splitlines()
    start = lines.index(HINT) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("  ")), len(lines))
    snippet = textwrap.dedent("\n".join(lines[start:end]))
    assert "import" in snippet
    namespace: dict = {}
    monkeypatch.chdir(tmp_path)  # anywhere: the printed path names the file the demo wrote
    exec(compile(snippet, "the demo's hint", "exec"), namespace)  # a fresh namespace: every name comes from it
    loaded = namespace["model"]
    assert isinstance(loaded, DigitsMLP)
    saved = torch.load(tmp_path / "demo" / "model.pt", weights_only=True)
    assert all(torch.equal(loaded.state_dict()[key], value) for key, value in saved.items())
