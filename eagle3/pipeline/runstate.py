"""``<run_id>/_run/state.json`` in the store: what a run started and how each stage went.

Written by the lease holder only (the scheduler's stage states, start/end times, handles;
the local backend's process ids, their host and command lines), read by ``status``,
``logs`` and ``down`` from any shell in any directory, and by the next run that takes
over a stale lease, to stop what a killed ``eagle3ctl`` left running. Each save is one
atomic object write, so a reader never sees half.

The run's local folder (``local_dir``: logs, the resolved config) stays on the machine that
runs it, under the working directory it was started from, named by run and store; its
absolute path is recorded here, so ``logs`` finds it from anywhere on that host.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from eagle3.errors import StoreError
from eagle3.store import ObjectStore

STATE = "_run/state.json"
STATE_ROOT = Path(".eagle3") / "runs"


def run_dir(run_id: str, store_uri: str, root: Path | None = None) -> Path:
    """Where a run started from this working directory keeps its logs and resolved config:
    ``.eagle3/runs/<run_id>-<store>/``, the store's URI hashed in, so runs of one id in two
    stores never share (or overwrite) a log."""
    import hashlib

    store = hashlib.sha256(store_uri.encode()).hexdigest()[:8]
    return ((root or STATE_ROOT) / f"{run_id}-{store}").resolve()


def read_state(store: ObjectStore, run_id: str) -> dict[str, Any]:
    """The last saved state of a run, or {} when none was saved (or it is unreadable)."""
    key = f"{run_id}/{STATE}"
    try:
        return json.loads(store.get_bytes(key)) if store.exists(key) else {}
    except (ValueError, StoreError):
        return {}


class RunState:
    """A small JSON document shared by the scheduler and the backend of one process."""

    def __init__(self, store: ObjectStore, run_id: str, local_dir: Path | None = None) -> None:
        self.store, self.run_id = store, run_id
        self.key = f"{run_id}/{STATE}"
        self._lock = threading.RLock()
        self.data: dict[str, Any] = read_state(store, run_id)
        self.data.setdefault("stages", {})
        self.data.setdefault("serve", {})
        recorded = self.data.get("local_dir")
        self.dir = local_dir.resolve() if local_dir is not None else Path(recorded) if recorded else run_dir(run_id, store.uri)

    def reload(self) -> dict[str, Any]:
        with self._lock:
            self.data = read_state(self.store, self.run_id) or self.data
            self.data.setdefault("stages", {})
            self.data.setdefault("serve", {})
            return self.data

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
            self.store.put_bytes(self.key, json.dumps(self.data, indent=2, sort_keys=True, default=str).encode() + b"\n")
