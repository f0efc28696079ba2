"""`dpkit train` run in each process of a shared launched group, as `dpkit launch -m dpkit train` runs it."""

from __future__ import annotations

import contextlib
import io
import logging


def train_here(argv: list[str]) -> tuple[int, str]:
    """In each launched process: `dpkit train argv` as a launched worker runs it; (exit code, what it printed)."""
    from dpkit.cli.main import main as dpkit_main

    said = io.StringIO()
    # dpkit's log lines too: the process's logging was set up by whichever job came first, onto its own stream
    handler = logging.StreamHandler(said)
    logging.getLogger("dpkit").addHandler(handler)
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            code = dpkit_main(["train", *argv])
    finally:
        logging.getLogger("dpkit").removeHandler(handler)
    return code, said.getvalue()
