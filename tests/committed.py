"""Where a committed stage's objects are: its attempt folder, named by the manifest."""

from __future__ import annotations

from pathlib import Path

from eagle3.manifest import read_manifest
from eagle3.store import ObjectStore


def key_of(store: ObjectStore, run_id: str, stage: str, name: str = "") -> str:
    """Store key of ``name`` in the stage's committed attempt folder (listed in the manifest or not)."""
    loaded = read_manifest(store, run_id, stage)
    assert loaded is not None, f"{run_id}/{stage} is not committed"
    return f"{loaded.manifest.prefix}/{name}".rstrip("/")


def path_of(store: ObjectStore, run_id: str, stage: str, name: str = "") -> Path:
    """Local path of ``name`` in the stage's committed attempt folder (file:// stores)."""
    path = store.local_path(key_of(store, run_id, stage, name))
    assert path is not None
    return path


def attempt_key(store: ObjectStore, run_id: str, stage: str, name: str = "") -> str:
    """Store key of ``name`` in the stage's one attempt folder, committed or not (a killed attempt)."""
    roots = {k.split("/")[2] for k in store.list(f"{run_id}/{stage}") if k.count("/") >= 3}
    assert len(roots) == 1, f"{run_id}/{stage} has attempt folders {sorted(roots)}"
    return f"{run_id}/{stage}/{roots.pop()}/{name}".rstrip("/")
