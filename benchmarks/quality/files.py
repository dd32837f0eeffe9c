"""The race's JSON files, written whole or not at all.

A step's result, a curve point and speculators' training record are what a later call reads to
know what is done; a call the deadline (or the machine) kills while one is written must leave the
old file or none, never half a file that the next call fails to parse.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: Path, obj: Any, indent: int = 2) -> None:
    """``path`` holds ``obj`` as JSON after this returns, or is as it was before (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(obj, indent=indent, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
