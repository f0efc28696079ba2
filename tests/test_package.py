"""The package root: the public API, loaded on first use."""

import importlib
import subprocess
import sys

import pytest

import dpkit


def test_the_public_api_is_re_exported():
    for name in dpkit.__all__:
        assert getattr(dpkit, name) is not None, name
    assert dpkit.DataParallel is dpkit.parallel.DataParallel


def test_a_launched_worker_loads_no_torch_before_the_script_does(tmp_path):
    """A launched worker's first code is dpkit.launch.worker's run_worker: it must not cost every process an import
    of torch (a torch-free script, such as the launcher tests' scripts, starts in milliseconds)."""
    script = tmp_path / "script.py"
    script.write_text("import sys\nassert 'torch' not in sys.modules, sorted(sys.modules)\n")
    code = "from dpkit.launch.worker import run_worker; run_worker()"
    result = subprocess.run(
        [sys.executable, "-c", code, "script", str(script)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_a_name_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dpkit.no_such_module")
