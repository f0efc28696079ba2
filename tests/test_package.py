"""The package root: the public API, and the old names of modules that moved, which still import."""

import importlib
import subprocess
import sys

import pytest

import dpkit


def test_the_public_api_is_re_exported():
    for name in dpkit.__all__:
        assert getattr(dpkit, name) is not None, name
    assert dpkit.DataParallel is dpkit.parallel.DataParallel


@pytest.mark.parametrize("old,new", sorted(dpkit.MOVED_MODULES.items()))
def test_a_moved_module_still_imports_under_its_old_name_with_a_warning(old, new, monkeypatch):
    # the import system caches a module under each name it was imported by: forget the old name first
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        moved = importlib.import_module(old)
    assert moved is importlib.import_module(new)
    assert sys.modules[old] is moved


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
