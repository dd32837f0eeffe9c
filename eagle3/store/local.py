"""``file://`` store: objects are files under a root folder, committed by rename.

Conditional writes (the lease) use ``link(2)`` for create-if-absent (atomic, and the file is
complete the moment it has its name) and an ``flock`` on a hidden lock file beside the
object for compare-and-swap; both hold on local disks and on NFSv4.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from eagle3.errors import StoreError
from eagle3.store.base import Copied, HashingWriter, ObjectInfo, ObjectStat, ObjectStore, PartialWrite, validate_key

# link(2) failures that mean "this filesystem or these folders cannot share the file": copy the bytes
_NO_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP)
# The store's disk refusing a write (read-only, full, no permission): one line naming the object.
_DISK_REFUSED = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EIO}


def _hidden(name: str) -> bool:
    """In-flight writes and lock files: never objects."""
    return name.startswith(".") and name.endswith((".partial", ".lock"))


def _fingerprint(st: os.stat_result) -> str:
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_ctime_ns}"


class LocalStore(ObjectStore):
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.uri = f"file://{self.root}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create store folder {self.root}: {e.strerror}") from None

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    @contextmanager
    def _writing(self, key: str) -> Iterator[None]:
        """The disk refusing a write to ``key`` as a StoreError naming it; a caller's own errors
        (about another file) pass through unchanged."""
        try:
            yield
        except OSError as e:
            if e.errno not in _DISK_REFUSED or (e.filename is not None and not str(e.filename).startswith(str(self.root))):
                raise
            raise StoreError(f"cannot write {self.uri}/{key}: {e.strerror}") from None

    def _tmp(self, path: Path) -> Path:
        return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")

    @staticmethod
    def _create(tmp: Path) -> BinaryIO:
        """Open a new file, making its folder; again if a sweep removed the folder just then."""
        for _ in range(3):
            tmp.parent.mkdir(parents=True, exist_ok=True)
            try:
                return open(tmp, "wb")
            except FileNotFoundError:
                continue
        return open(tmp, "wb")

    @contextmanager
    def writer(self, key: str) -> Iterator[HashingWriter]:
        with self._writing(key), self._writer(key) as w:
            yield w

    @contextmanager
    def _writer(self, key: str) -> Iterator[HashingWriter]:
        path = self._path(key)
        tmp = self._tmp(path)
        try:
            with self._create(tmp) as f:
                w = HashingWriter(f)
                yield w
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            # stat after the rename: a rename moves ctime on most filesystems
            w.info = ObjectInfo(key, w.size, w.hexdigest(), _fingerprint(path.stat()))  # type: ignore[attr-defined]
        finally:
            tmp.unlink(missing_ok=True)

    @contextmanager
    def reader(self, key: str) -> Iterator[BinaryIO]:
        path = self._path(key)
        try:
            f = open(path, "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise StoreError(f"missing object {self.uri}/{key}") from None
        except PermissionError as e:
            raise StoreError(f"cannot read {self.uri}/{key}: {e.strerror}") from None
        with f:
            yield f

    def stat(self, key: str) -> ObjectStat | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(st.st_mode):  # a folder is not an object
            return None
        return ObjectStat(st.st_size, _fingerprint(st))

    def stat_prefix(self, prefix: str) -> dict[str, ObjectStat]:
        out: dict[str, ObjectStat] = {}
        for key in self.list(prefix):
            st = self.stat(key)
            if st is not None:
                out[key] = st
        return out

    def list(self, prefix: str) -> list[str]:
        base = self.root / validate_key(prefix.strip("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, _, files in os.walk(base):
            for name in files:
                if _hidden(name):
                    continue
                keys.append(Path(dirpath, name).relative_to(self.root).as_posix())
        return sorted(keys)

    def partial_writes(self, prefix: str) -> list[PartialWrite]:
        base = self.root / validate_key(prefix.strip("/")) if prefix.strip("/") else self.root
        out = []
        for dirpath, _, files in os.walk(base):
            for name in files:
                if not (_hidden(name) and name.endswith(".partial")):
                    continue
                path = Path(dirpath, name)
                try:
                    written = path.stat().st_mtime
                except FileNotFoundError:  # finished (renamed) or removed just now
                    continue
                folder = path.parent.relative_to(self.root).as_posix()
                key = f"{folder}/{name[1:].rsplit('.', 2)[0]}" if folder != "." else name[1:].rsplit(".", 2)[0]
                out.append(PartialWrite(key, written, path.relative_to(self.root).as_posix()))
        return sorted(out, key=lambda p: p.handle)

    def remove_partial(self, partial: PartialWrite) -> None:
        (self.root / partial.handle).unlink(missing_ok=True)

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._writing(key):
            path.unlink(missing_ok=True)
        # folders are not objects: drop the ones this left empty (a swept attempt folder)
        parent = path.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:  # not empty (or gone): stop
                break
            parent = parent.parent

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def copy(self, src: str, dst: str, if_fingerprint: str | None = None) -> Copied:
        """A hard link where the filesystem allows one (no second copy of the bytes; removing or
        replacing either name never touches the other), else a byte copy. A link shares the
        inode, so it moves the source's ctime and with it its fingerprint: ``Copied`` says so."""
        with self._writing(dst):
            return self._copy(src, dst, if_fingerprint)

    def _copy(self, src: str, dst: str, if_fingerprint: str | None) -> Copied:
        s, d = self._path(src), self._path(dst)
        try:
            before = s.stat()
        except (FileNotFoundError, NotADirectoryError):
            raise StoreError(f"missing object {self.uri}/{src}") from None
        if if_fingerprint is not None and _fingerprint(before) != if_fingerprint:
            raise StoreError(f"{self.uri}/{src} changed since it was checked; not copied")
        tmp = self._tmp(d)
        try:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(s, tmp)
            except OSError as e:
                if e.errno not in _NO_LINK:
                    raise
                shutil.copyfile(s, tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            after = s.stat()
            # ctime moves with the link itself; an in-place write would move mtime
            if (after.st_ino, after.st_mtime_ns, after.st_size) != (before.st_ino, before.st_mtime_ns, before.st_size):
                raise StoreError(f"{self.uri}/{src} changed while it was copied; not copied")
            os.replace(tmp, d)
            tmp.unlink(missing_ok=True)  # still there when d already was this very file (rename does nothing)
            copied = d.stat()  # after the rename and unlink, which move ctime
            return Copied(ObjectStat(copied.st_size, _fingerprint(copied)), _fingerprint(s.stat()))
        except FileNotFoundError:
            raise StoreError(f"missing object {self.uri}/{src}") from None
        finally:
            tmp.unlink(missing_ok=True)

    def get_file(self, key: str, path: Path) -> Path:
        src = self._path(key)
        if not src.exists():
            raise StoreError(f"missing object {self.uri}/{key}")
        return src

    # -- conditional writes

    def _write_tmp(self, path: Path, data: bytes) -> Path:
        tmp = self._tmp(path)
        with self._create(tmp) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    @contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def create_exclusive(self, key: str, data: bytes) -> str | None:
        with self._writing(key):
            return self._create_exclusive(key, data)

    def _create_exclusive(self, key: str, data: bytes) -> str | None:
        path = self._path(key)
        tmp = self._write_tmp(path, data)
        try:
            with self._locked(path):
                os.link(tmp, path)
            return hashlib.sha256(data).hexdigest()
        except FileExistsError:
            return None
        finally:
            tmp.unlink(missing_ok=True)

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        try:
            data = self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return data, hashlib.sha256(data).hexdigest()

    def replace_if(self, key: str, data: bytes, version: str) -> str | None:
        with self._writing(key):
            return self._replace_if(key, data, version)

    def _replace_if(self, key: str, data: bytes, version: str) -> str | None:
        path = self._path(key)
        tmp = self._write_tmp(path, data)
        try:
            with self._locked(path):
                current = self.get_versioned(key)
                if current is None or current[1] != version:
                    return None
                os.replace(tmp, path)
                return hashlib.sha256(data).hexdigest()
        finally:
            tmp.unlink(missing_ok=True)

    def delete_if(self, key: str, version: str) -> bool:
        path = self._path(key)
        with self._writing(key), self._locked(path):
            current = self.get_versioned(key)
            if current is None:
                return True
            if current[1] != version:
                return False
            path.unlink()
            return True
