"""The session-wide cache of `dpkit train` runs (see strategy_runs.py)."""

import pytest
from strategy_runs import Runs


@pytest.fixture(scope="session")
def train_run(tmp_path_factory, groups) -> Runs:
    """train_run(strategy, devices, batch_size) -> the run's folder (model.pt, metrics.json)."""
    return Runs(tmp_path_factory.mktemp("train-runs"), groups)
