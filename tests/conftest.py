import os
import signal

# Two test workers and the processes their tests start share the machine's cores, so torch's OpenMP threads
# often wait for a core; by default they spin while they wait, burning the cycles the others need (about a
# tenth of the suite's CPU). Passive waiting changes no result, only who gets the core. Set before torch loads
# OpenMP; the processes the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from launched_group import Groups

# The processes the tests start (a launched group runs functions of test modules) import the helpers the tests
# share (closeness.py) from this folder, as this process does.
TESTS = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(path for path in (TESTS, os.environ.get("PYTHONPATH")) if path)

# DPKIT_TEST_THREADS=n: this process computes with n intra-op threads instead of torch's one per core, as on a
# host with another core count; a test that asserts bitwise equality must hold whatever n is (tests/closeness.py).
# torch sets a thread's count when it first asks for it, to the last count set by any thread: without this, a
# replica's worker that set its share first would decide the count of this thread for the rest of the session.
torch.set_num_threads(int(os.environ.get("DPKIT_TEST_THREADS") or torch.get_num_threads()))

# A shell that starts `make test` in the background without job control hands it SIGINT ignored, and a
# process that inherits an ignored SIGINT never sees Ctrl-C (nor do the processes it starts). The tests of
# Ctrl-C need the terminal's behaviour: Python's own handler here, the default disposition in children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# The test files that take longest, slowest first (`make test` prints the slowest tests). `make test` deals
# whole files out to its workers in collection order, so starting with these keeps one worker from finishing
# a long file alone at the end.
SLOWEST_FILES = [  # by wall time in `make test` (2026-12-03, summed over each file's tests; 2026-12-06's new ones)
    "tests/launch/test_restarts_and_progress.py",
    "tests/test_docs.py",
    "tests/launch/test_collective_faults.py",
    "tests/strategies/test_hsdp.py",
    "tests/cli/test_train.py",
    "tests/test_compilation.py",
    "tests/strategies/test_compile_sharded.py",
    "tests/engine/test_engine_equivalence.py",
    "tests/cli/test_profile.py",
    "tests/strategies/test_faults.py",
    "tests/strategies/test_fsdp.py",
    "tests/cli/test_bench.py",
    "tests/launch/test_launch.py",
    "tests/strategies/test_multinode.py",  # one two-node launch since 2026-12-06, not two
    "tests/recipe/test_recipe_faults.py",  # its runs in the test's process since 2026-12-06 (27 s -> 10 s alone)
    "tests/engine/test_wrapped_keys.py",
    "tests/strategies/test_models_people_train.py",
    "tests/cli/test_plan.py",
    "tests/test_examples.py",
    "tests/engine/test_auto_strategy.py",
    "tests/checkpoint/test_state_faults.py",
    "tests/strategies/test_equivalence.py",
    "tests/cli/test_doctor.py",
    "tests/launch/test_slurm.py",
    "tests/strategies/test_repeatability.py",
    "tests/strategies/test_resume_matrix.py",
    "tests/recipe/test_resume_from.py",
    "tests/strategies/test_compression.py",
    "tests/recipe/test_train_compressed.py",
    "tests/engine/test_process_streams.py",
    "tests/strategies/test_localsgd_diloco.py",
    "tests/recipe/test_train_streams.py",
    "tests/engine/test_background_save.py",
    "tests/recipe/test_save_memory.py",
    "tests/recipe/test_background_stops.py",
    "tests/cli/test_strategy_settings.py",
    "tests/engine/test_prefetching_loop.py",
    "tests/cli/test_profile_balance.py",
]


def _slowest_first(items: list) -> None:
    rank = {name: position for position, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep order


def pytest_collection_modifyitems(config, items):
    _slowest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def groups(tmp_path_factory):
    """groups(N): N processes under dpkit's launcher, started once and reused by every test (launched_group.py)."""
    started = Groups(tmp_path_factory.mktemp("groups"))
    yield started
    started.stop()
