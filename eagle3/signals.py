"""SIGTERM and SIGHUP as Ctrl-C: the process unwinds (``finally`` blocks, temporary folders,
unfinished uploads aborted) instead of dying where it stands."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (`eagle3ctl down`, a stage stopped by the run, a CI timeout) and SIGHUP (terminal
    closed) raise KeyboardInterrupt in the main thread while the block runs."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
