"""``file://`` store: objects are files under a root folder, committed by rename."""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from eagle3.errors import StoreError
from eagle3.store.base import HashingWriter, ObjectInfo, ObjectStore, validate_key


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
    def writer(self, key: str) -> Iterator[HashingWriter]:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
        try:
            with open(tmp, "wb") as f:
                w = HashingWriter(f)
                yield w
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            w.info = ObjectInfo(key, w.size, w.hexdigest())  # type: ignore[attr-defined]
        finally:
            tmp.unlink(missing_ok=True)

    @contextmanager
    def reader(self, key: str) -> Iterator[BinaryIO]:
        path = self._path(key)
        try:
            f = open(path, "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise StoreError(f"missing object {self.uri}/{key}") from None
        with f:
            yield f

    def size(self, key: str) -> int | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None  # a folder is not an object

    def list(self, prefix: str) -> list[str]:
        base = self.root / validate_key(prefix.strip("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.endswith(".partial") and name.startswith("."):
                    continue
                keys.append(Path(dirpath, name).relative_to(self.root).as_posix())
        return sorted(keys)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def get_file(self, key: str, path: Path) -> Path:
        src = self._path(key)
        if not src.exists():
            raise StoreError(f"missing object {self.uri}/{key}")
        return src
