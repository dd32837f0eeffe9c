"""Local files a config names (prompts), as content: what goes into the input key.

A stage's input key hashes the sha256 of the prompt file, not its path: editing the file
reruns generate, moving it does not, and its copy uploaded for Kubernetes pods
(``<run_id>/inputs/<sha256>/<name>`` in the store, ``eagle3.k8s.inputs``) keys the same,
its digest read from its key. The digests the CLI saw are recorded in the run's store prefix
(``<run_id>/_run/inputs.json``) so a stage that is complete still verifies after the local
file is gone.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from eagle3.errors import StoreError
from eagle3.store import ObjectStore

# (section, field) of settings whose value may be a local file the stage reads.
FILE_FIELDS: tuple[tuple[str, str], ...] = (("generate", "prompts"), ("evaluate", "prompts"))
RECORD = "_run/inputs.json"
UPLOADED = re.compile(r"/inputs/([0-9a-f]{64})/[^/]+$")  # a copy in the run's store, named by its sha256


def local_file(value: Any) -> Path | None:
    """The local path a setting names, or None for builtin:, s3://, uploaded copies and unset values."""
    if not isinstance(value, str) or not value or value.startswith(("builtin:", "s3://")) or UPLOADED.search(value):
        return None
    return Path(value[len("file://"):] if value.startswith("file://") else value).expanduser()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _record(store: ObjectStore, run_id: str) -> dict[str, str]:
    key = f"{run_id}/{RECORD}"
    try:
        return json.loads(store.get_bytes(key)) if store.exists(key) else {}
    except (ValueError, StoreError):
        return {}


def file_digest(value: Any, store: ObjectStore | None = None, run_id: str | None = None) -> str | None:
    """sha256 of the file a setting names: from an uploaded copy's key, read from disk, else as
    recorded for this run; None for builtin: and other s3:// values."""
    uploaded = UPLOADED.search(value) if isinstance(value, str) else None
    if uploaded:
        return uploaded.group(1)
    path = local_file(value)
    if path is None:
        return None
    if path.is_file():
        return sha256_file(path)
    if store is not None and run_id is not None:
        return _record(store, run_id).get(str(path.resolve()))
    return None


def record_digests(store: ObjectStore, cfg: Any) -> dict[str, str]:
    """Record the digests of the readable local files the config names (run start)."""
    seen = _record(store, cfg.run_id)
    new = dict(seen)
    for section, name in FILE_FIELDS:
        path = local_file(getattr(getattr(cfg, section), name))
        if path is not None and path.is_file():
            new[str(path.resolve())] = sha256_file(path)
    if new != seen:
        store.put_bytes(f"{cfg.run_id}/{RECORD}", json.dumps(new, indent=2, sort_keys=True).encode())
    return new


def keyed_config(section: str, values: dict[str, Any], store: ObjectStore | None, run_id: str | None) -> dict[str, Any]:
    """A config section for the input key: file-valued fields become their content digest."""
    out = dict(values)
    for sec, name in FILE_FIELDS:
        if sec == section and name in out:
            digest = file_digest(out[name], store, run_id)
            if digest is not None:
                out[name] = {"sha256": digest}
    return out
