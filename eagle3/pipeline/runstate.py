"""``.eagle3/runs/<run_id>/state.json``: what a run started and how each stage went.

Written by the scheduler (stage states, start/end times, handles) and the local backend
(process ids of stages and of the server), read by ``status``, ``logs`` and ``down``
from another shell. Writes are atomic (temp file + rename) so a reader never sees half.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

STATE_ROOT = Path(".eagle3") / "runs"


def run_dir(run_id: str, root: Path | None = None) -> Path:
    """The run's local state folder (logs, resolved config, state.json), under the working directory."""
    return (root or STATE_ROOT) / run_id


class RunState:
    """A small JSON document shared by the scheduler and the backend of one process."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.path = directory / "state.json"
        self._lock = threading.RLock()
        self.data: dict[str, Any] = self.read(directory)
        self.data.setdefault("stages", {})
        self.data.setdefault("serve", {})

    @staticmethod
    def read(directory: Path) -> dict[str, Any]:
        """The last saved state of a run, or {} when it never ran here (or the file is unreadable)."""
        try:
            return json.loads((directory / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def update(self, section: str, name: str | None = None, **fields: Any) -> None:
        """Merge ``fields`` into ``data[section][name]`` (or ``data[section]``) and save."""
        with self._lock:
            target = self.data.setdefault(section, {})
            if name is not None:
                target = target.setdefault(name, {})
            target.update(fields)
            self.save()

    def set(self, **fields: Any) -> None:
        with self._lock:
            self.data.update(fields)
            self.save()

    def save(self) -> None:
        with self._lock:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".state.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(self.data, indent=2, sort_keys=True, default=str) + "\n")
            os.replace(tmp, self.path)


def pid_alive(pid: int) -> bool:
    """Does a process with this pid exist (ours or, with PermissionError, someone else's)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
