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
def test_a_moved_module_still_imports_under_its_old_name_with_a_warning(old, new):
    # a fresh interpreter: the import system caches a module once imported
    code = (
        f"import warnings, importlib\nwith warnings.catch_warnings(record=True) as seen:\n"
        f"    warnings.simplefilter('always')\n    old = importlib.import_module({old!r})\n"
        f"assert old is importlib.import_module({new!r}), old\n"
        f"assert any(issubclass(w.category, DeprecationWarning) and {new!r} in str(w.message) for w in seen)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_a_name_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dpkit.no_such_module")
