"""The manifest protocol: ``manifest.json`` is written last and is the only commit point.

A stage writes its objects under ``<run_id>/<stage>/`` through :class:`StageOutput`,
which records each object's size and sha256 while it streams, and journals it so a
killed attempt can be resumed without re-hashing. The stage is complete only when its
manifest parses, its input key matches, and every listed object is present with its
size (``deep``: and its sha256, plus the stage's own content checks).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from eagle3 import __version__
from eagle3.errors import ManifestError
from eagle3.store import ObjectStore
from eagle3.store.base import HashingWriter

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
ATTEMPT = "_attempt.json"
JOURNAL = "_journal"


class ObjectEntry(BaseModel):
    key: str  # relative to the stage prefix
    size: int
    sha256: str


class Manifest(BaseModel):
    schema_version: int
    stage: str
    run_id: str
    input_key: str
    code_version: str
    upstream: dict[str, str]  # stage -> manifest digest
    objects: list[ObjectEntry]
    stats: dict[str, Any]
    started_at: str
    finished_at: str

    def object(self, key: str) -> ObjectEntry:
        for o in self.objects:
            if o.key == key:
                return o
        raise ManifestError(f"manifest of {self.run_id}/{self.stage} lists no object {key!r}")

    def keys(self, prefix: str = "") -> list[str]:
        return [o.key for o in self.objects if o.key.startswith(prefix)]


def stage_prefix(run_id: str, stage: str) -> str:
    return f"{run_id}/{stage}"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def digest_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def compute_input_key(stage: str, config: dict[str, Any], upstream: dict[str, str], code_version: str = __version__) -> str:
    """Hash of what determines a stage's outputs: its config, its inputs, the code."""
    blob = json.dumps(
        {"stage": stage, "config": config, "upstream": upstream, "code": code_version},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class LoadedManifest:
    manifest: Manifest
    digest: str  # sha256 of manifest.json's bytes


def read_manifest(store: ObjectStore, run_id: str, stage: str) -> LoadedManifest | None:
    """The stage's manifest, or None when absent. Unparsable manifests raise ManifestError."""
    key = f"{stage_prefix(run_id, stage)}/{MANIFEST}"
    if not store.exists(key):
        return None
    raw = store.get_bytes(key)
    try:
        m = Manifest.model_validate_json(raw)
    except ValidationError:
        raise ManifestError(f"manifest {store.uri}/{key} does not parse") from None
    if m.schema_version != SCHEMA_VERSION:
        raise ManifestError(f"manifest {store.uri}/{key} has schema version {m.schema_version}, expected {SCHEMA_VERSION}")
    return LoadedManifest(m, digest_bytes(raw))


ContentCheck = Callable[[ObjectStore, Manifest], list[str]]


@dataclass
class Verdict:
    stage: str
    complete: bool
    problems: list[str] = field(default_factory=list)
    manifest: LoadedManifest | None = None

    @property
    def reason(self) -> str:
        return self.problems[0] if self.problems else "complete"


def verify_stage(
    store: ObjectStore,
    run_id: str,
    stage: str,
    input_key: str | None = None,
    deep: bool = False,
    content_check: ContentCheck | None = None,
) -> Verdict:
    """Is the stage complete? Names every missing, truncated or corrupted object."""
    prefix = stage_prefix(run_id, stage)
    try:
        loaded = read_manifest(store, run_id, stage)
    except ManifestError as e:
        return Verdict(stage, False, [str(e)])
    if loaded is None:
        return Verdict(stage, False, [f"no manifest at {store.uri}/{prefix}/{MANIFEST}"])
    m = loaded.manifest
    problems: list[str] = []
    if m.stage != stage or m.run_id != run_id:
        problems.append(f"manifest at {prefix} names {m.run_id}/{m.stage}")
    if input_key is not None and m.input_key != input_key:
        problems.append(f"{prefix}: input key changed (config, upstream or code differ from the committed run)")
    for o in m.objects:
        key = f"{prefix}/{o.key}"
        size = store.size(key)
        if size is None:
            problems.append(f"missing object {store.uri}/{key}")
        elif size != o.size:
            problems.append(f"truncated or altered object {store.uri}/{key}: {size} bytes, manifest says {o.size}")
        elif deep and store.sha256(key) != o.sha256:
            problems.append(f"corrupted object {store.uri}/{key}: sha256 differs from the manifest")
    if deep and not problems and content_check is not None:
        problems.extend(content_check(store, m))
    return Verdict(stage, not problems, problems, loaded)


class ObjectWriter:
    """Writes objects of a stage attempt, each hashed while written and journaled.

    Rank 0 writes through its :class:`StageOutput`, which begins and commits the attempt;
    another process of the same stage (a torchrun rank) writes through a plain
    ObjectWriter after rank 0 began, and rank 0 carries the entries into its manifest
    with :meth:`StageOutput.include`. A killed attempt's journal covers both.
    """

    def __init__(self, store: ObjectStore, run_id: str, stage: str) -> None:
        self.store, self.run_id, self.stage = store, run_id, stage
        self.prefix = stage_prefix(run_id, stage)
        self.entries: dict[str, ObjectEntry] = {}

    def _k(self, name: str) -> str:
        return self.store.join(self.prefix, name)

    @contextmanager
    def writer(self, name: str, journal: bool = True) -> Iterator[HashingWriter]:
        if name in (MANIFEST, ATTEMPT) or name.startswith(JOURNAL + "/"):
            raise ManifestError(f"stage output name {name!r} is reserved")
        with self.store.writer(self._k(name)) as w:
            yield w
        info = w.info  # type: ignore[attr-defined]
        entry = ObjectEntry(key=name, size=info.size, sha256=info.sha256)
        self.entries[name] = entry
        if journal:
            self.store.put_bytes(self._k(f"{JOURNAL}/{name}.json"), entry.model_dump_json().encode())

    def put_bytes(self, name: str, data: bytes, journal: bool = True) -> ObjectEntry:
        with self.writer(name, journal) as w:
            w.write(data)
        return self.entries[name]

    def put_json(self, name: str, obj: Any, journal: bool = True) -> ObjectEntry:
        return self.put_bytes(name, json.dumps(obj, indent=2, sort_keys=True).encode() + b"\n", journal)

    def put_file(self, name: str, path: Path, journal: bool = True) -> ObjectEntry:
        with self.writer(name, journal) as w, open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                w.write(chunk)
        return self.entries[name]


class StageOutput(ObjectWriter):
    """Writes one stage attempt's objects and commits them with the manifest, last.

    Resume: objects journaled by an earlier attempt with the same input key are
    offered by :meth:`recovered`; a changed input key wipes the stage folder first.
    Only rank 0 begins and commits; other ranks write through an :class:`ObjectWriter`.
    """

    def __init__(self, store: ObjectStore, run_id: str, stage: str, input_key: str, upstream: dict[str, str]) -> None:
        super().__init__(store, run_id, stage)
        self.input_key, self.upstream = input_key, upstream
        self._recovered: dict[str, ObjectEntry] = {}
        self.started_at = now_iso()
        self._t0 = time.monotonic()

    def begin(self) -> None:
        """Uncommit the stage, then keep or wipe the previous attempt's partial objects."""
        self.store.delete(self._k(MANIFEST))
        previous = None
        if self.store.exists(self._k(ATTEMPT)):
            try:
                previous = json.loads(self.store.get_bytes(self._k(ATTEMPT))).get("input_key")
            except ValueError:
                previous = None
        if previous != self.input_key:
            self.store.delete_prefix(self.prefix)
            self.store.put_bytes(self._k(ATTEMPT), json.dumps({"input_key": self.input_key, "started_at": self.started_at}).encode())
            return
        for jkey in self.store.list(f"{self.prefix}/{JOURNAL}"):
            try:
                e = ObjectEntry.model_validate_json(self.store.get_bytes(jkey))
            except ValidationError:
                continue
            if self.store.size(self._k(e.key)) == e.size:
                self._recovered[e.key] = e

    def recovered(self, prefix: str = "") -> dict[str, ObjectEntry]:
        """Objects a previous attempt (same input key) finished writing, by name."""
        return {k: v for k, v in sorted(self._recovered.items()) if k.startswith(prefix)}

    def adopt(self, name: str) -> ObjectEntry:
        """Carry a recovered object into this attempt's manifest."""
        e = self._recovered[name]
        self.entries[name] = e
        return e

    def read_recovered(self, name: str) -> bytes | None:
        """A recovered object's bytes, adopted into this attempt, if they still hash to what was
        journaled; None when there is no such object or it no longer matches (write it again)."""
        e = self._recovered.get(name)
        if e is None:
            return None
        data = self.store.get_bytes(self._k(name))
        if hashlib.sha256(data).hexdigest() != e.sha256:
            return None
        self.adopt(name)
        return data

    def include(self, entry: ObjectEntry) -> None:
        """Carry an object another rank wrote (and journaled) into this attempt's manifest."""
        if self.store.size(self._k(entry.key)) != entry.size:  # None when missing
            raise ManifestError(f"{self._k(entry.key)}: not written as another rank reported ({entry.size} bytes)")
        self.entries[entry.key] = entry

    def drop(self, name: str) -> None:
        """Remove an object from this attempt (e.g. a part merged into a final file)."""
        self.entries.pop(name, None)
        self._recovered.pop(name, None)
        self.store.delete(self._k(name))
        self.store.delete(self._k(f"{JOURNAL}/{name}.json"))

    def commit(self, stats: dict[str, Any]) -> LoadedManifest:
        stats = {"duration_s": round(time.monotonic() - self._t0, 3), **stats}
        m = Manifest(
            schema_version=SCHEMA_VERSION,
            stage=self.stage,
            run_id=self.run_id,
            input_key=self.input_key,
            code_version=__version__,
            upstream=self.upstream,
            objects=sorted(self.entries.values(), key=lambda e: e.key),
            stats=stats,
            started_at=self.started_at,
            finished_at=now_iso(),
        )
        raw = m.model_dump_json(indent=2).encode() + b"\n"
        self.store.put_bytes(self._k(MANIFEST), raw)
        # After the commit point: housekeeping only; a crash here leaves a complete stage.
        self.store.delete_prefix(f"{self.prefix}/{JOURNAL}")
        self.store.delete(self._k(ATTEMPT))
        return LoadedManifest(m, digest_bytes(raw))
