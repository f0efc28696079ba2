"""The worker's side: a launched worker's first code (it dies with its launcher) and its last (exit_worker)."""

from __future__ import annotations

import ctypes
import logging
import os
import runpy
import signal
import sys
from collections.abc import Sequence

from dpkit.launch.environment import LAUNCHER_PID_VARIABLE

log = logging.getLogger("dpkit")

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


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
    if mode == "module":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


def exit_worker(code: int) -> None:
    """Leave a launched worker process without interpreter teardown.

    Under load, a gloo worker that has finished cleanly (process group destroyed, files written) can
    still abort during interpreter teardown ("terminate called without an active exception", no
    Python frame left), which the launcher reports as a failed run. The work is done and flushed by
    then, so a worker skips that teardown.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
