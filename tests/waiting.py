"""Waiting in tests for what a process does, never for a length of time.

A test that races a deadline fails on a loaded machine however right the code is. Tests here
wait for an event of the pipeline's own (a file in the store, a line in a log, a state in the
run's record) or for the process to end, as long as that takes. The only clock is a hang
guard: pytest-timeout's per-test limit (``timeout`` in pyproject.toml, ``HANG_GUARD_S`` for
the long tests that mark themselves), far above what any of them takes on a slow machine; on a
hang it fails the test, and ``finally`` blocks stop what it started.
"""

from __future__ import annotations

import subprocess
import time
from typing import Callable

HANG_GUARD_S = 3600  # pytest.mark.timeout of tests that run whole pipelines many times over
POLL_S = 0.05  # how often a condition is looked at: latency, not a verdict


def until(condition: Callable[[], bool], proc: subprocess.Popen | None = None) -> bool:
    """Wait until ``condition()`` holds (True), or until ``proc`` has exited first (False)."""
    while not condition():
        if proc is not None and proc.poll() is not None:
            return condition()
        time.sleep(POLL_S)
    return True
