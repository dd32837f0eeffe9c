"""Progress lines: what a running stage prints, what a backend reads back.

A stage reports progress as one ``EAGLE3_PROGRESS {...}`` line on stderr; the local backend
reads it from the stage's log, the Kubernetes backend from its pod's log.
"""

from __future__ import annotations

import json
import sys
from typing import Any

PROGRESS_TAG = "EAGLE3_PROGRESS"


def emit_progress(record: dict[str, Any]) -> None:
    """One ``EAGLE3_PROGRESS {...}`` line on stderr, in one write: the ranks of a torchrun stage share
    the pipe, and print()'s separate write of the newline let two ranks' lines run into one."""
    sys.stderr.write(f"{PROGRESS_TAG} {json.dumps(record)}\n")
    sys.stderr.flush()


def parse_progress(line: str) -> dict | None:
    """The JSON of an ``EAGLE3_PROGRESS {...}`` line, else None."""
    i = line.find(PROGRESS_TAG + " ")
    if i < 0:
        return None
    try:
        rec = json.loads(line[i + len(PROGRESS_TAG) + 1:])
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None
