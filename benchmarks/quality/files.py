"""The race's result files: written whole or not at all, and valid only while what they name is there.

A step's result file is how a later run knows the step is done. A run killed while one is written leaves
the old file or none, never half of one; a result naming a file or folder that is gone (a work folder
cleaned by hand) counts as not done, so its step runs again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: Path, obj: Any) -> None:
    """``path`` holds ``obj`` as JSON after this returns, or is as it was before (a temporary file renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(obj, indent=1, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_result(path: Path) -> dict | None:
    """A step's result if it is done: the file parses as a JSON object and every path it lists exists."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict) or not all(Path(p).exists() for p in result.get("paths", [])):
        return None
    return result
