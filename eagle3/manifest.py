"""The manifest protocol: ``manifest.json`` is written last and is the only commit point.

A stage attempt writes its objects into an attempt folder, ``<run_id>/<stage>/<root>/``
(``root`` = ``attempt-<first 12 hex of the input key>``), through :class:`StageOutput`,
which records each object's size, sha256 and the store's fingerprint while it streams, and
journals it so a killed attempt can be resumed: a rerun adopts each journaled object that
still verifies, by the same rule as a skip (:func:`check_object`), and discards the rest.
The committed output stays where it is while a new attempt runs beside it; the new
attempt's manifest (``<run_id>/<stage>/manifest.json``, naming its root) replaces it at the
commit, and only then are other attempt folders removed. So a rerun that fails, or is killed, or is refused,
never costs the finished output.

A stage is complete only when its manifest parses, its input key matches, and every listed
object is present with its size and its content digest: objects up to
:data:`SMALL_OBJECT` are re-hashed (sha256), larger ones are compared by the store's
fingerprint (S3 ETag, inode + mtime + ctime on disk) recorded at write time, re-hashed only
when that changed (``deep``: every sha256, plus the stage's own content checks). The manifest
must also list every object its stage always writes (:attr:`eagle3.stages.StageSpec.required`).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from eagle3 import __version__
from eagle3.errors import ManifestError, StoreError
from eagle3.stages import Required, required_objects
from eagle3.store import ObjectStore
from eagle3.store.base import HashingWriter, ObjectStat

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)  # 1: objects directly under the stage prefix (root "")
MANIFEST = "manifest.json"
ATTEMPT = "_attempt.json"
JOURNAL = "_journal"
VERIFIED = "_verified.json"  # fingerprints re-hashed and found intact (a copied store's new inodes)
SMALL_OBJECT = 8 << 20  # up to this size a skip re-hashes the object; above it, the fingerprint


class ObjectEntry(BaseModel):
    key: str  # relative to the attempt folder
    size: int
    sha256: str
    fingerprint: str | None = None  # the store's token at write time (ETag, inode+mtime+ctime)


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
    root: str = ""  # the attempt folder holding the objects, relative to <run_id>/<stage>
    config: dict[str, Any] | None = None  # the config sections the input key hashed (to name what changed)

    @property
    def prefix(self) -> str:
        """Where the objects are: ``<run_id>/<stage>/<root>``."""
        return attempt_prefix(self.run_id, self.stage, self.root)

    def object(self, key: str) -> ObjectEntry:
        for o in self.objects:
            if o.key == key:
                return o
        raise ManifestError(f"manifest of {self.run_id}/{self.stage} lists no object {key!r}")

    def object_key(self, name: str) -> str:
        """The store key of a listed object (ManifestError when the manifest does not list it)."""
        self.object(name)
        return f"{self.prefix}/{name}"

    def keys(self, prefix: str = "") -> list[str]:
        return [o.key for o in self.objects if o.key.startswith(prefix)]


def stage_prefix(run_id: str, stage: str) -> str:
    return f"{run_id}/{stage}"


def attempt_prefix(run_id: str, stage: str, root: str) -> str:
    return f"{run_id}/{stage}/{root}" if root else f"{run_id}/{stage}"


def attempt_root(input_key: str, committed_root: str | None) -> str:
    """The folder an attempt for ``input_key`` writes into: ``attempt-<key12>``, or its twin
    ``attempt-<key12>-b`` when the committed output already occupies that one (a forced rerun,
    or a rerun of a committed output that no longer verifies). Every rank derives the same
    root from the committed manifest, which does not change until rank 0 commits."""
    base = f"attempt-{input_key[:12]}"
    return f"{base}-b" if committed_root == base else base


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
    if m.schema_version not in READABLE_SCHEMAS:
        raise ManifestError(f"manifest {store.uri}/{key} has schema version {m.schema_version}, expected {SCHEMA_VERSION}")
    return LoadedManifest(m, digest_bytes(raw))


def committed_key(store: ObjectStore, run_id: str, stage: str, name: str) -> str | None:
    """Store key of an object of another stage's committed output; None when not committed or not listed."""
    try:
        loaded = read_manifest(store, run_id, stage)
    except ManifestError:
        return None
    if loaded is None or name not in loaded.manifest.keys(name):
        return None
    return loaded.manifest.object_key(name)


ContentCheck = Callable[[ObjectStore, Manifest], list[str]]


@dataclass
class Verdict:
    stage: str
    complete: bool
    problems: list[str] = field(default_factory=list)
    manifest: LoadedManifest | None = None
    rehashed: int = 0  # objects read back because no cheaper digest check applied
    fingerprints: dict[str, str] = field(default_factory=dict)  # object -> the version whose content checked out
    stale: str | None = None  # the problem line when the manifest is of another input key

    @property
    def reason(self) -> str:
        return self.problems[0] if self.problems else "complete"

    @property
    def damage(self) -> list[str]:
        """Every problem but a changed input key: what is wrong with the output itself."""
        return [p for p in self.problems if p != self.stale]


def _read_verified(store: ObjectStore, run_id: str, stage: str, root: str) -> dict[str, str]:
    key = f"{stage_prefix(run_id, stage)}/{VERIFIED}"
    try:
        data = json.loads(store.get_bytes(key)) if store.exists(key) else {}
    except (ValueError, StoreError):
        return {}
    return data.get("objects", {}) if isinstance(data, dict) and data.get("root") == root else {}


def verify_stage(
    store: ObjectStore,
    run_id: str,
    stage: str,
    input_key: str | None = None,
    deep: bool = False,
    content_check: ContentCheck | None = None,
    required: tuple[Required, ...] | None = None,
) -> Verdict:
    """Is the stage complete? Names every missing, truncated or corrupted object.

    Every object's size and content digest is checked (module docstring: small objects are
    re-hashed, large ones compared by fingerprint); ``deep`` re-hashes everything and runs
    the stage's content checks. The manifest must list every object the stage always writes
    (``required``, by default the stage registry's :attr:`StageSpec.required`).
    """
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
    stale = None
    if input_key is not None and m.input_key != input_key:
        stale = f"{prefix}: input key changed (config, upstream or code differ from the committed run)"
        problems.append(stale)
    stats: dict[str, ObjectStat] = store.stat_prefix(m.prefix) if m.objects else {}
    verified = _read_verified(store, run_id, stage, m.root)
    newly_verified: dict[str, str] = {}
    checked: dict[str, str] = {}
    rehashed = 0
    for o in m.objects:
        key = f"{m.prefix}/{o.key}"
        c = check_object(store, key, o, stats.get(key), verified.get(o.key), deep)
        rehashed += c.rehashed
        if c.problem:
            problems.append(c.problem)
            continue
        assert c.fingerprint is not None
        checked[o.key] = c.fingerprint
        if c.newly_verified:
            newly_verified[o.key] = c.fingerprint
    problems += missing_required(store, m, required_objects(stage) if required is None else required)
    intact = all(p == stale for p in problems)  # the objects hold what the manifest says, whatever its key
    if newly_verified and intact:
        remember_verified(store, run_id, stage, m.root, newly_verified, verified)
    if deep and intact and content_check is not None:
        problems.extend(content_check(store, m))
    return Verdict(stage, not problems, problems, loaded, rehashed, checked if not problems else {}, stale)


@dataclass(frozen=True)
class ObjectCheck:
    problem: str | None  # None: present, of its size, and its content digest holds
    fingerprint: str | None = None  # the version found
    rehashed: bool = False
    newly_verified: bool = False  # a large object re-hashed at a new fingerprint, and intact


def check_object(store: ObjectStore, key: str, entry: ObjectEntry, st: ObjectStat | None,
                 known: str | None = None, deep: bool = False, against: str = "manifest") -> ObjectCheck:
    """Does the object at ``key`` still hold what ``entry`` recorded? The one digest rule of a
    skip and of a resume: its size, then its sha256 unless it is large and still at the
    fingerprint recorded at write time (or ``known``, one re-hashed since); ``deep``
    re-hashes every object. ``against`` names what recorded ``entry`` (manifest, journal)."""
    if st is None:
        return ObjectCheck(f"missing object {store.uri}/{key}")
    if st.size != entry.size:
        return ObjectCheck(f"truncated or altered object {store.uri}/{key}: {st.size} bytes, {against} says "
                           f"{entry.size}", st.fingerprint)
    untouched = st.fingerprint in (entry.fingerprint, known)
    if not deep and untouched and entry.size > SMALL_OBJECT:
        return ObjectCheck(None, st.fingerprint)
    if store.sha256(key) != entry.sha256:
        return ObjectCheck(f"corrupted object {store.uri}/{key}: sha256 differs from the {against}", st.fingerprint,
                           rehashed=True)
    return ObjectCheck(None, st.fingerprint, rehashed=True, newly_verified=not untouched and entry.size > SMALL_OBJECT)


def missing_required(store: ObjectStore, m: Manifest, required: tuple[Required, ...]) -> list[str]:
    """What the manifest fails to list of the objects its stage always writes (``Required``):
    a name or pattern it lists no object for, or a pattern whose count an index object fixes
    (extract's shards: one per entry of ``index.json``'s ``shards``) listed a different number
    of times. A manifest edited, or written by a stage that forgot an object, is incomplete."""
    problems = []
    where = f"manifest of {m.run_id}/{m.stage}"
    for r in required:
        n = sum(fnmatchcase(o.key, r.pattern) for o in m.objects)
        if r.counted_by is None:
            if n == 0:
                problems.append(f"{where} lists no object {r.pattern!r}, which the stage always writes")
            continue
        index, field_name = r.counted_by
        want = _listed_count(store, m, index, field_name)
        if want is None:
            problems.append(f"{where}: cannot count {r.pattern!r}: {index} is not listed or has no list {field_name!r}")
        elif n != want:
            problems.append(f"{where} lists {n} objects {r.pattern!r}; its {index} lists {want}")
    return problems


def _listed_count(store: ObjectStore, m: Manifest, index: str, field_name: str) -> int | None:
    if index not in m.keys(index):
        return None
    try:
        value = json.loads(store.get_bytes(m.object_key(index))).get(field_name)
    except (ValueError, AttributeError, StoreError):
        return None
    return len(value) if isinstance(value, list) else None


def remember_verified(store: ObjectStore, run_id: str, stage: str, root: str, objects: dict[str, str],
                      known: dict[str, str] | None = None) -> None:
    """Remember fingerprints of objects whose bytes are known intact at that version (re-hashed
    after the store was copied: new inodes; or hard-linked by another run's adoption: a new
    ctime), so the next skip is cheap again. A cache: losing it costs a re-read."""
    if known is None:
        known = _read_verified(store, run_id, stage, root)
    body = json.dumps({"root": root, "objects": {**known, **objects}}, sort_keys=True).encode()
    store.put_bytes(f"{stage_prefix(run_id, stage)}/{VERIFIED}", body)


class ObjectWriter:
    """Writes objects of a stage attempt, each hashed while written and journaled.

    Rank 0 writes through its :class:`StageOutput`, which begins and commits the attempt;
    another process of the same stage (a torchrun rank) writes through a plain
    ObjectWriter on the same attempt root after rank 0 began, and rank 0 carries the entries
    into its manifest with :meth:`StageOutput.include`. A killed attempt's journal covers both.
    """

    def __init__(self, store: ObjectStore, run_id: str, stage: str, root: str) -> None:
        self.store, self.run_id, self.stage, self.root = store, run_id, stage, root
        self.prefix = attempt_prefix(run_id, stage, root)
        self.entries: dict[str, ObjectEntry] = {}

    def _k(self, name: str) -> str:
        return self.store.join(self.prefix, name)

    @staticmethod
    def _check_name(name: str) -> None:
        if name in (MANIFEST, ATTEMPT, VERIFIED) or name.startswith(JOURNAL + "/"):
            raise ManifestError(f"stage output name {name!r} is reserved")

    @contextmanager
    def writer(self, name: str, journal: bool = True) -> Iterator[HashingWriter]:
        self._check_name(name)
        with self.store.writer(self._k(name)) as w:
            yield w
        info = w.info  # type: ignore[attr-defined]
        entry = ObjectEntry(key=name, size=info.size, sha256=info.sha256, fingerprint=info.fingerprint)
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

    def copy_in(self, name: str, src_key: str, verified: ObjectEntry, at: str | None) -> str:
        """Another stage output's object as this attempt's ``name``, copied by the store (a hard
        link on disk, a server-side copy on S3) only if it is still at fingerprint ``at``, the
        version whose content the caller verified against ``verified`` (its size and sha256,
        which this entry takes). Returns the source's fingerprint after the copy."""
        self._check_name(name)
        copied = self.store.copy(src_key, self._k(name), if_fingerprint=at)
        if copied.stat.size != verified.size:
            self.store.delete(self._k(name))
            raise ManifestError(f"{src_key}: {copied.stat.size} bytes, its manifest says {verified.size}")
        entry = ObjectEntry(key=name, size=verified.size, sha256=verified.sha256, fingerprint=copied.stat.fingerprint)
        self.entries[name] = entry
        self.store.put_bytes(self._k(f"{JOURNAL}/{name}.json"), entry.model_dump_json().encode())
        return copied.source_fingerprint


class StageOutput(ObjectWriter):
    """Writes one stage attempt's objects beside the committed output and commits them with the
    manifest, last.

    Resume: objects journaled by an earlier attempt in the same root (same input key) are
    offered by :meth:`recovered`; ``fresh`` (``--force``) starts the root over. Only rank 0
    begins and commits; other ranks write through an :class:`ObjectWriter`.
    """

    def __init__(self, store: ObjectStore, run_id: str, stage: str, input_key: str, upstream: dict[str, str],
                 root: str | None = None, config: dict[str, Any] | None = None) -> None:
        if root is None:
            committed = committed_root(store, run_id, stage)
            root = attempt_root(input_key, committed)
        super().__init__(store, run_id, stage, root)
        self.input_key, self.upstream, self.config = input_key, upstream, config
        self._recovered: dict[str, ObjectEntry] = {}
        self.started_at = now_iso()
        self._t0 = time.monotonic()

    def begin(self, fresh: bool = False) -> None:
        """Start (or resume) this attempt's folder; the committed output is left alone."""
        previous = None
        if not fresh and self.store.exists(self._k(ATTEMPT)):
            try:
                previous = json.loads(self.store.get_bytes(self._k(ATTEMPT))).get("input_key")
            except ValueError:
                previous = None
        if previous != self.input_key:
            self.store.delete_prefix(self.prefix)
            self.store.put_bytes(self._k(ATTEMPT), json.dumps({"input_key": self.input_key, "started_at": self.started_at}).encode())
            return
        self._recover()

    def _recover(self) -> None:
        """Offer what an earlier attempt (same input key) journaled, only where it verifies as a
        skip verifies a committed object (:func:`check_object`: the fingerprint where it is
        unchanged, otherwise a re-hash against the journaled sha256). An object that fails is
        discarded, with one line saying so, and the stage does its work again; objects the
        journal does not vouch for (written as the attempt died) are removed."""
        stats = self.store.stat_prefix(self.prefix)
        keep = {self._k(ATTEMPT)}
        for jkey in sorted(k for k in stats if k.startswith(f"{self.prefix}/{JOURNAL}/")):
            try:
                e = ObjectEntry.model_validate_json(self.store.get_bytes(jkey))
            except (ValidationError, StoreError):
                continue
            if jkey != self._k(f"{JOURNAL}/{e.key}.json"):
                continue
            c = check_object(self.store, self._k(e.key), e, stats.get(self._k(e.key)), against="journal")
            if c.problem is None:
                self._recovered[e.key] = e
                keep |= {jkey, self._k(e.key)}
            elif self._k(e.key) in stats:
                print(f"{self.stage}: discarded {e.key} of the interrupted attempt ({c.problem}); "
                      "its work is done again", file=sys.stderr, flush=True)
        self.store.delete_many(sorted(k for k in stats if k not in keep))

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
            root=self.root,
            config=self.config,
        )
        raw = m.model_dump_json(indent=2).encode() + b"\n"
        stage_dir = stage_prefix(self.run_id, self.stage)
        self.store.put_bytes(f"{stage_dir}/{MANIFEST}", raw)
        # After the commit point: housekeeping only; a crash here leaves a complete stage, and
        # the next commit sweeps what this one did not.
        self.store.delete_prefix(f"{self.prefix}/{JOURNAL}")
        self.store.delete(self._k(ATTEMPT))
        mine = self.prefix + "/"
        # the replaced output, abandoned attempts, a stale fingerprint cache
        self.store.delete_many([k for k in self.store.list(stage_dir)
                                if not k.startswith(mine) and k != f"{stage_dir}/{MANIFEST}"])
        return LoadedManifest(m, digest_bytes(raw))


def unfinished_attempts(store: ObjectStore, run_id: str, stage: str) -> list[str]:
    """Roots of the stage's attempt folders begun and not (yet) committed, oldest first: where a
    running, killed or stopped attempt writes (a commit removes its folder's attempt record)."""
    prefix = stage_prefix(run_id, stage)
    started = []
    for key in store.list(prefix):
        root, _, name = key[len(prefix) + 1:].partition("/")
        if name != ATTEMPT:
            continue
        try:
            when = json.loads(store.get_bytes(key)).get("started_at", "")
        except (ValueError, StoreError):  # being rewritten, or just swept by a commit
            continue
        started.append((when, root))
    return [root for _, root in sorted(started)]


def committed_root(store: ObjectStore, run_id: str, stage: str) -> str | None:
    """The committed output's attempt folder (None: nothing committed, or a manifest that does not parse)."""
    try:
        loaded = read_manifest(store, run_id, stage)
    except ManifestError:
        return None
    return None if loaded is None else loaded.manifest.root
