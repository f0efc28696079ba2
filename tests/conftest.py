import signal

import pytest
import torch

# A shell that starts `make test` in the background without job control hands it SIGINT ignored, and a
# process that inherits an ignored SIGINT never sees Ctrl-C (nor do the processes it starts). The tests of
# Ctrl-C need the terminal's behaviour: Python's own handler here, the default disposition in children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
