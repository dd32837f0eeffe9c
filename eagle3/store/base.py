"""The object-store interface shared by the local and S3 backends."""

from __future__ import annotations

import hashlib
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from eagle3.errors import StoreError

_KEY_PART = re.compile(r"^[A-Za-z0-9._=+@,-]+$")
CHUNK = 8 << 20


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    sha256: str
    fingerprint: str | None = None  # the store's own token for this version (see ObjectStat)


@dataclass(frozen=True)
class ObjectStat:
    """What a store tells about an object without reading it back.

    ``fingerprint`` changes whenever the object's bytes may have changed: the ETag on S3 (a
    rewrite gets a new one), inode + mtime + ctime on local disk (an in-place write moves
    mtime; resetting mtime moves ctime, which no user can set). Equal fingerprints mean the
    object was not touched since it was written; unequal ones mean only "read it back".
    """

    size: int
    fingerprint: str


@dataclass(frozen=True)
class Copied:
    """What :meth:`ObjectStore.copy` made: the copy's stat, and the source's fingerprint after
    the copy (a hard link shares the source's inode and moves its ctime, so its fingerprint)."""

    stat: ObjectStat
    source_fingerprint: str


@dataclass(frozen=True)
class PartialWrite:
    """A write begun and never finished (its writer killed): invisible to listings, never an
    object. On disk a hidden ``.<name>.<id>.partial`` file, on S3 an unfinished multipart upload."""

    key: str  # the object it would have become
    written_at: float  # epoch seconds of its last write
    handle: str  # what the store needs to remove it (the file's key, the upload id)


def validate_key(key: str) -> str:
    """Reject keys that could escape the store root or are ambiguous.

    Keys are relative, '/'-separated, with no empty, '.' or '..' parts.
    """
    if not key or key.startswith("/") or "\\" in key:
        raise StoreError(f"invalid object key {key!r}: keys are relative '/'-separated paths")
    for part in key.split("/"):
        if part in ("", ".", "..") or not _KEY_PART.match(part):
            raise StoreError(f"invalid object key {key!r}: bad path part {part!r}")
    return key


class HashingWriter:
    """A write-only stream that counts bytes and hashes them as they pass."""

    def __init__(self, sink: BinaryIO | None = None) -> None:
        self._sink = sink
        self._sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._sha.update(data)
        self.size += len(data)
        if self._sink is not None:
            self._sink.write(data)
        return len(data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


@contextmanager
def local_copy(store: "ObjectStore", key: str) -> Iterator[Path]:
    """A local path to an object for the duration of a block: in place on local disk, else a
    download into a temporary folder that is removed when the block exits (even on error)."""
    path = store.local_path(key)
    if path is not None:
        yield path
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="eagle3-object-") as tmp:
        yield store.get_file(key, Path(tmp) / Path(key).name)


class ObjectStore(ABC):
    """Keys are validated relative paths; values are immutable once written."""

    uri: str

    @abstractmethod
    @contextmanager
    def writer(self, key: str) -> Iterator[HashingWriter]:
        """Yield a stream; the object appears atomically when the block exits cleanly.

        After the block, ``stream.info`` holds the committed :class:`ObjectInfo`.
        """

    @abstractmethod
    @contextmanager
    def reader(self, key: str) -> Iterator[BinaryIO]:
        """Yield a readable binary stream of the object."""

    @abstractmethod
    def stat(self, key: str) -> ObjectStat | None:
        """Size and fingerprint, or None when the object does not exist."""

    @abstractmethod
    def stat_prefix(self, prefix: str) -> dict[str, ObjectStat]:
        """Every object under ``prefix`` (a folder) with its stat, in as few calls as the store allows."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (a '/'-terminated folder), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one object; deleting a missing object is not an error."""

    # Conditional writes: what a lease needs so two writers on any machines never both win.

    @abstractmethod
    def create_exclusive(self, key: str, data: bytes) -> str | None:
        """Create the object only if no object has the key: its version token, or None when one exists."""

    @abstractmethod
    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and a version token for :meth:`replace_if`, or None when absent."""

    @abstractmethod
    def replace_if(self, key: str, data: bytes, version: str) -> str | None:
        """Overwrite the object only if it is still at ``version``: the new version token, or None
        when it changed or is gone."""

    @abstractmethod
    def delete_if(self, key: str, version: str) -> bool:
        """Delete the object only if it is still at ``version``; False when it changed (a missing
        object counts as deleted: True)."""

    def partial_writes(self, prefix: str) -> list[PartialWrite]:
        """Writes under ``prefix`` begun and not finished: those in flight, and those a killed
        writer left (see :func:`eagle3.store.stale_partial_writes`)."""
        return []

    def remove_partial(self, partial: PartialWrite) -> None:
        """Remove what a partial write left (a write still in flight then fails)."""

    def size(self, key: str) -> int | None:
        """Size in bytes, or None when the object does not exist."""
        st = self.stat(key)
        return None if st is None else st.size

    def local_path(self, key: str) -> Path | None:
        """A path readable in place, for stores on local disk; None otherwise."""
        return None

    # Conveniences built on the primitives above.

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        with self.writer(key) as w:
            w.write(data)
        return w.info  # type: ignore[attr-defined]

    def put_file(self, key: str, path: Path) -> ObjectInfo:
        with self.writer(key) as w, open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                w.write(chunk)
        return w.info  # type: ignore[attr-defined]

    def get_bytes(self, key: str) -> bytes:
        with self.reader(key) as r:
            return r.read()

    def get_file(self, key: str, path: Path) -> Path:
        """Copy an object to a local file (no copy when the store is local)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        # Download beside the target and rename: a dropped connection never leaves a
        # half file where a later run could take it for the object.
        tmp = path.with_name(f".{path.name}.partial")
        try:
            with self.reader(key) as r, open(tmp, "wb") as f:
                while chunk := r.read(CHUNK):
                    f.write(chunk)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def copy(self, src: str, dst: str, if_fingerprint: str | None = None) -> Copied:
        """Copy an object to a new key of the same store; ``dst`` appears whole or not at all.

        Refused (StoreError) when ``src`` is missing, or is no longer at ``if_fingerprint`` (the
        version a caller checked) before or while it is copied. This default streams the bytes
        through; the local and S3 stores copy without reading them (hard link, CopyObject).
        """
        before = self.copy_source(src, if_fingerprint)
        with self.reader(src) as r, self.writer(dst) as w:
            while chunk := r.read(CHUNK):
                w.write(chunk)
        after = self.stat(src)
        if after is None or after.fingerprint != before.fingerprint:
            self.delete(dst)
            raise StoreError(f"{self.uri}/{src} changed while it was copied; not copied")
        copied = self.stat(dst)
        if copied is None:
            raise StoreError(f"copying {self.uri}/{src}: {dst} did not appear")
        return Copied(copied, after.fingerprint)

    def copy_source(self, src: str, if_fingerprint: str | None) -> ObjectStat:
        """The stat of an object about to be copied; StoreError when missing or not at ``if_fingerprint``."""
        st = self.stat(src)
        if st is None:
            raise StoreError(f"missing object {self.uri}/{src}")
        if if_fingerprint is not None and st.fingerprint != if_fingerprint:
            raise StoreError(f"{self.uri}/{src} changed since it was checked; not copied")
        return st

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def sha256(self, key: str) -> str:
        h = hashlib.sha256()
        with self.reader(key) as r:
            while chunk := r.read(CHUNK):
                h.update(chunk)
        return h.hexdigest()

    def has_prefix(self, prefix: str) -> bool:
        """Is any object under ``prefix``?"""
        return bool(self.list(prefix))

    def delete_many(self, keys: list[str]) -> int:
        for key in keys:
            self.delete(key)
        return len(keys)

    def delete_prefix(self, prefix: str) -> int:
        return self.delete_many(self.list(prefix))

    def join(self, *parts: str) -> str:
        return validate_key("/".join(p.strip("/") for p in parts if p))


def stale_partial_writes(store: ObjectStore, prefix: str, idle_s: float,
                         now: float | None = None) -> list[PartialWrite]:
    """Partial writes under ``prefix`` not written to for ``idle_s`` seconds: a live writer
    writes continually (a local file's mtime, an upload's newest part move as it streams), so
    one idle that long belongs to a writer that is gone."""
    now = time.time() if now is None else now
    return [p for p in store.partial_writes(prefix) if p.written_at < now - idle_s]
