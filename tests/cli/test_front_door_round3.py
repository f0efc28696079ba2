"""What a torchrun + DDP user tripped on (issue 46): torchrun's spellings at `dpkit launch`, the overview's count of
strategies, and `dpkit profile --strategies` comparing strategies side by side."""

from __future__ import annotations

from dpkit.cli.main import main
from dpkit.strategies import available_strategies


def test_the_overview_names_every_strategy_train_offers(capsys):
    assert main([]) == 0
    overview = " ".join(capsys.readouterr().out.split())
    assert f"{len(available_strategies())} strategies behind one training loop" in overview
    assert f"({', '.join(available_strategies())})" in overview
