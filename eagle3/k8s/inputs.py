"""Local files a config names, carried into the run's store for stages that cannot see this disk.

A Kubernetes pod does not see the machine eagle3ctl runs on, so before the first Job every local
file the config names (``generate.prompts``, ``evaluate.prompts``) is uploaded to
``<run_id>/inputs/<sha256>/<basename>`` of the run's store, and the config the pods get names
that object instead (``with_inputs``). The key holds the content's sha256: the same content lands
at the same key (a second upload is skipped), a changed file at a new one, and ``input_digest``
gives the local file and its uploaded copy the same digest, so an input key that hashes input
content is the same for the config eagle3ctl checks and the config the pods run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.errors import ConfigError, StoreError
from eagle3.inputs import file_digest, local_file, sha256_file
from eagle3.store import ObjectStore

INPUT_FIELDS = ("generate.prompts", "evaluate.prompts")
_UNSAFE = re.compile(r"[^A-Za-z0-9._=+@,-]")


@dataclass(frozen=True)
class LocalInput:
    field: str  # e.g. generate.prompts
    path: Path
    sha256: str
    size: int
    key: str  # store key: <run_id>/inputs/<sha256>/<basename>
    uri: str  # what the pods read: the store URI + key


def field_value(cfg: PipelineConfig, field: str) -> str | None:
    section, name = field.split(".")
    return getattr(getattr(cfg, section), name)


def local_path(value: str | None) -> Path | None:
    """The local file a value names, or None for builtin:, s3:// and uploaded values."""
    return local_file(value)


def input_digest(value: str | None) -> str | None:
    """sha256 of the content a value names (an uploaded copy: from its key), the digest the input
    key hashes; None for builtin:, other s3:// objects and missing files."""
    return file_digest(value)


def local_inputs(cfg: PipelineConfig, missing_ok: bool = False) -> list[LocalInput]:
    """The local files the config names, hashed; a missing one is a ConfigError naming its field
    (or, with ``missing_ok``, left out)."""
    out = []
    for field in INPUT_FIELDS:
        path = local_path(field_value(cfg, field))
        if path is None:
            continue
        if not path.is_file():
            if missing_ok:
                continue
            raise ConfigError(f"{field}: file not found: {path} (local files are uploaded to the store from where "
                              f"eagle3ctl runs; run it where the file is, or name an s3:// object)")
        sha, size = sha256_file(path), path.stat().st_size
        key = f"{cfg.run_id}/inputs/{sha}/{_UNSAFE.sub('_', path.name) or 'input'}"
        out.append(LocalInput(field, path, sha, size, key, f"{cfg.store.uri.rstrip('/')}/{key}"))
    return out


def upload_inputs(store: ObjectStore, inputs: list[LocalInput]) -> list[str]:
    """Put each input into the store unless its object is already there; one line per input."""
    lines = []
    for item in inputs:
        if store.size(item.key) == item.size:  # content-addressed: present means the same bytes
            lines.append(f"{item.field}: {item.path} is in the store already ({item.uri})")
            continue
        info = store.put_file(item.key, item.path)
        if info.sha256 != item.sha256:
            store.delete(item.key)
            raise StoreError(f"{item.field}: {item.path} changed while it was uploaded; run again")
        lines.append(f"{item.field}: uploaded {item.path} ({item.size} bytes, sha256 {item.sha256[:12]}…) to {item.uri}")
    return lines


def with_inputs(cfg: PipelineConfig, inputs: list[LocalInput]) -> PipelineConfig:
    """The config with each local file replaced by its object in the store."""
    for item in inputs:
        section, name = item.field.split(".")
        part = getattr(cfg, section).model_copy(update={name: item.uri})
        cfg = cfg.model_copy(update={section: part})
    return cfg
