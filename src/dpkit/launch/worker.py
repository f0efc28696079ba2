"""The worker's side: a launched worker's first code (it dies with its launcher) and its last (exit_worker)."""

from __future__ import annotations

import ctypes
import faulthandler
import importlib.machinery
import importlib.util
import logging
import os
import runpy
import signal
import sys
from collections.abc import Callable, Iterable, Sequence

from dpkit.launch.environment import LAUNCHER_PID_VARIABLE, STACKS_DIR_VARIABLE, stack_file

log = logging.getLogger("dpkit")

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# the signal on which a worker writes every thread's Python stack to its stack file (the launcher's hang report)
STACK_SIGNAL = signal.SIGUSR1
_BEFORE_EXIT: list[Callable[[], None]] = []  # before_worker_exit's actions
_STACK_FILES: list = []  # open for the life of the process: faulthandler writes to their descriptors


def die_with_parent(parent_pid: int | None = None) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); exit now if it already has.

    Returns whether the request was made (False off Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning(
            "launch: prctl(PR_SET_PDEATHSIG) failed (errno %d); this worker may outlive its launcher",
            ctypes.get_errno(),
        )
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the launcher died before the request took effect: nobody will ever wait for us
    return True


def run_worker(argv: Sequence[str] | None = None) -> None:
    """A launched worker's first code: die with the launcher, then run `script args…` or `-m module args…`
    as `python` itself would."""
    mode, target, *args = list(sys.argv[1:] if argv is None else argv)
    launcher_pid = os.environ.get(LAUNCHER_PID_VARIABLE)
    die_with_parent(int(launcher_pid) if launcher_pid else None)
    write_stacks_on_signal()
    try:
        if mode == "module":
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except Exception as error:
        # a script's first code loads no torch here (a launch of a torch-free script stays cheap): a
        # CollectiveMismatch exists only if its module was loaded, so look it up only then
        collectives = sys.modules.get("dpkit.observe.collectives")
        if collectives is None or not isinstance(error, collectives.CollectiveMismatch):
            raise
        # its one line goes to the launcher's summary (torchrun's error file); the process leaves at once, as
        # collectives that will never pair are still pending and gloo's teardown would wait for them
        import traceback

        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        traceback.print_exc()
        ErrorHandler().record_exception(error)
        exit_worker(1)


def write_stacks_on_signal() -> None:
    """Under dpkit's launcher: every thread's Python stack goes to this rank's stack file on STACK_SIGNAL (the
    hang report) and on a fatal signal (gloo's abort), for the launcher to name the user's line."""
    folder = os.environ.get(STACKS_DIR_VARIABLE)
    if not folder or not os.path.isdir(folder) or _STACK_FILES:
        return
    handle = open(stack_file(folder, os.environ.get("RANK", "0")), "w")  # noqa: SIM115 (open for life)
    _STACK_FILES.append(handle)
    faulthandler.enable(handle, all_threads=True)
    faulthandler.register(STACK_SIGNAL, handle, all_threads=True)


def check_script(script: str, module: bool = False) -> None:
    """Refuse, before any worker starts, a script `run_worker` would not find: a missing file (a folder or zip
    without __main__.py), or with module=True a module that `python -m` in this folder would not find."""
    if not isinstance(script, str):
        raise TypeError(f"script: expected a file name or module name as a str, got {type(script).__name__}")
    if module:
        problem = _module_problem(script)
        if problem:
            raise ValueError(
                f"script: {problem}; with module=True the script is a module to run as `python -m`, importable "
                "from here (installed, or a package in the current folder)"
            )
        return
    if os.path.isfile(script):
        return
    if os.path.isdir(script):
        if os.path.isfile(os.path.join(script, "__main__.py")):
            return
        raise ValueError(f"script: {script!r} is a folder without __main__.py; expected a Python file to run")
    raise ValueError(
        f"script: no such file {script!r}; expected a Python file to run (or, with module=True, a module name)"
    )


def _module_problem(name: str) -> str | None:
    """Why `python -m name` would not find the module (None: it would, or this process cannot tell).

    A worker runs with the current folder first on sys.path. The module is looked for as the import system
    looks, finder by finder, package by package, without running any package's code here (nor reading this
    process's imported modules: the worker starts afresh). A package whose __init__ extends its own __path__
    is rare; for a submodule not found that way, python -m's own search (which imports the parents) decides.
    A package that fails to import here is left to the workers, which say why."""
    parts = name.split(".")
    if not name or any(not part.isidentifier() for part in parts):
        return f"{name!r} is not a module name (dotted identifiers, e.g. mypackage.train)"
    here = os.getcwd()
    added = "" not in sys.path and here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        spec, locations = None, None
        for depth in range(1, len(parts) + 1):
            fullname = ".".join(parts[:depth])
            spec = _find_spec(fullname, locations)
            if spec is None:
                return f"no module named {fullname!r}" if depth == 1 else _imported_search(name)
            locations = spec.submodule_search_locations
            if locations is None and depth < len(parts):
                return f"no module named {name!r} ({fullname!r} is not a package)"
        if locations is not None and _find_spec(name + ".__main__", locations) is None:
            return _imported_search(name)
        return None
    finally:
        if added:
            sys.path.remove(here)


def _find_spec(fullname: str, locations: Iterable[str] | None) -> importlib.machinery.ModuleSpec | None:
    """The spec the import system's finders give `fullname` within its parent's search locations (None for a
    top-level name), without importing anything."""
    path = None if locations is None else list(locations)
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(fullname, path) if find is not None else None
        if spec is not None:
            return spec
    return None


def _imported_search(name: str) -> str | None:
    """python -m's own search for `name` (its parent packages imported), for what the finders alone missed."""
    try:
        spec = importlib.util.find_spec(name)
        if spec is None:
            return f"no module named {name!r}"
        if spec.submodule_search_locations is not None and importlib.util.find_spec(name + ".__main__") is None:
            return f"{name!r} is a package without a __main__ module"
        return None
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing and (name == missing or name.startswith(missing + ".")):
            return f"no module named {missing!r}"
        return None
    except Exception:  # the package's own import failed here: not a missing module
        return None


def before_worker_exit(action: Callable[[], None]) -> None:
    """Run `action` when exit_worker leaves, which skips the atexit handlers (a background save in flight is
    written first: engine/background_save.py)."""
    _BEFORE_EXIT.append(action)


def exit_worker(code: int) -> None:
    """Leave a launched worker process without interpreter teardown.

    Under load, a gloo worker that has finished cleanly (process group destroyed, files written) can
    still abort during interpreter teardown ("terminate called without an active exception", no
    Python frame left), which the launcher reports as a failed run. The work is done and flushed by
    then, so a worker skips that teardown; what was registered with before_worker_exit runs first.
    """
    for action in _BEFORE_EXIT:
        action()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
