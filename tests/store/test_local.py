"""The file:// store: atomic commit by rename, hashing while writing, safe keys."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from eagle3.errors import StoreError
from eagle3.store import open_store
from eagle3.store.local import LocalStore


def test_round_trip_size_and_sha256(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}")
    data = os.urandom(50_000)
    info = store.put_bytes("run/stage/blob.bin", data)
    assert (info.key, info.size, info.sha256) == ("run/stage/blob.bin", len(data), hashlib.sha256(data).hexdigest())
    assert store.get_bytes("run/stage/blob.bin") == data
    assert store.size("run/stage/blob.bin") == len(data)
    assert store.sha256("run/stage/blob.bin") == info.sha256
    assert store.local_path("run/stage/blob.bin") == tmp_path / "run/stage/blob.bin"
    assert store.get_file("run/stage/blob.bin", tmp_path / "elsewhere") == tmp_path / "run/stage/blob.bin"  # no copy


def test_put_file_streams(tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3 << 20))
    store = LocalStore(tmp_path / "store")
    info = store.put_file("a/b.bin", src)
    assert info.sha256 == hashlib.sha256(src.read_bytes()).hexdigest()


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_bytes("r/s/obj", b"old")
    with pytest.raises(RuntimeError):
        with store.writer("r/s/obj") as w:
            w.write(b"new but unfinished")
            raise RuntimeError("producer died")
    assert store.get_bytes("r/s/obj") == b"old"  # the committed version is untouched
    assert sorted(p.name for p in (tmp_path / "r/s").iterdir()) == ["obj"]  # no .partial left


def test_partial_files_are_not_listed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    with store.writer("r/s/obj") as w:
        w.write(b"x")
        assert store.list("r/s") == []  # in flight: invisible
        assert not store.exists("r/s/obj")
    assert store.list("r/s") == ["r/s/obj"]


def test_listing_and_prefix_delete(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    for key in ["r1/vocab/a.json", "r1/vocab/sub/b.json", "r1/vocabulary/c.json", "r2/vocab/d.json"]:
        store.put_bytes(key, b"x")
    assert store.list("r1/vocab") == ["r1/vocab/a.json", "r1/vocab/sub/b.json"]
    assert store.list("r1/vocab/") == store.list("r1/vocab")
    assert store.list("r1/absent") == []
    assert len(store.list("")) == 4
    assert store.delete_prefix("r1/vocab") == 2
    assert store.list("r1") == ["r1/vocabulary/c.json"]
    store.delete("r1/absent")  # not an error


def test_a_folder_is_not_an_object(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_bytes("r/s/obj", b"x")
    assert store.size("r/s") is None and not store.exists("r/s")
    assert store.size("r/s/obj/deeper") is None
    with pytest.raises(StoreError, match="missing object"):
        store.get_bytes("r/s")


@pytest.mark.parametrize("key", ["../escape", "/abs/key", "a/../b", "a//b", "a/./b", "", "a\\b", "a/b c", "a/\x00"])
def test_invalid_keys_are_rejected(tmp_path: Path, key: str) -> None:
    store = LocalStore(tmp_path / "store")
    for op in (lambda: store.put_bytes(key, b"x"), lambda: store.size(key), lambda: store.get_bytes(key)):
        with pytest.raises(StoreError, match="invalid object key"):
            op()
    assert not (tmp_path / "escape").exists()


def test_listing_cannot_escape_the_root(tmp_path: Path) -> None:
    (tmp_path / "outside.txt").write_text("secret")
    store = LocalStore(tmp_path / "store")
    with pytest.raises(StoreError, match="invalid object key"):
        store.list("..")
    with pytest.raises(StoreError, match="invalid object key"):
        store.delete_prefix("../")


def test_open_store_uris(tmp_path: Path) -> None:
    assert open_store(f"file://{tmp_path}/x").root == (tmp_path / "x")
    assert open_store(str(tmp_path / "y")).root == (tmp_path / "y")
    for bad, why in [("file://", "empty path"), ("gs://b/p", "scheme must be"), ("s3:///p", "expected s3://bucket")]:
        with pytest.raises(StoreError, match=why):
            open_store(bad)


def test_unwritable_root_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(StoreError, match="cannot create store folder"):
        LocalStore(tmp_path / "file" / "store")


def test_copy_is_a_hard_link_that_outlives_the_source(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.put_bytes("a/obj", b"x" * 1000)
    before = store.stat("a/obj")
    copied = store.copy("a/obj", "b/obj", if_fingerprint=before.fingerprint)
    src, dst = store.local_path("a/obj"), store.local_path("b/obj")
    assert src.stat().st_ino == dst.stat().st_ino  # no second copy of the bytes
    # the link moved the shared inode's ctime: the copy and the source report the same new fingerprint
    assert copied.stat == store.stat("b/obj") and copied.source_fingerprint == store.stat("a/obj").fingerprint
    assert copied.source_fingerprint != before.fingerprint
    store.delete("a/obj")
    assert store.get_bytes("b/obj") == b"x" * 1000


def test_copy_falls_back_to_bytes_where_links_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(tmp_path / "s")
    store.put_bytes("a/obj", b"payload")
    before = store.stat("a/obj")

    def no_link(src, dst):
        raise OSError(errno.EXDEV, "cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    copied = store.copy("a/obj", "b/obj")
    assert store.get_bytes("b/obj") == b"payload"
    assert store.local_path("a/obj").stat().st_ino != store.local_path("b/obj").stat().st_ino
    assert copied.source_fingerprint == before.fingerprint  # the source was not touched


def test_copy_refuses_a_changed_or_missing_source(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.put_bytes("a/obj", b"v1")
    seen = store.stat("a/obj").fingerprint
    store.put_bytes("a/obj", b"v2")  # rewritten after it was checked
    with pytest.raises(StoreError, match="changed since it was checked"):
        store.copy("a/obj", "b/obj", if_fingerprint=seen)
    with pytest.raises(StoreError, match="missing object"):
        store.copy("a/none", "b/none")
    assert store.list("b") == []  # nothing half-made
