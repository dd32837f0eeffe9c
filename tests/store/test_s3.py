"""S3Store against the real moto server (S3 wire protocol, authentication on)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from eagle3.errors import StoreError
from eagle3.store import open_store
from eagle3.store import s3 as s3mod
from tests.fixtures_s3 import MotoS3

pytestmark = pytest.mark.s3


def _raw_key(uri: str, key: str) -> str:
    prefix = uri.split("/", 3)[3]
    return f"{prefix}/{key}"


def test_round_trip_reports_size_and_sha256(s3_store_uri: str) -> None:
    store = open_store(s3_store_uri)
    store.check()
    data = os.urandom(100_000)
    info = store.put_bytes("run/stage/blob.bin", data)
    assert (info.size, info.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert store.get_bytes("run/stage/blob.bin") == data
    assert store.size("run/stage/blob.bin") == len(data)
    assert store.sha256("run/stage/blob.bin") == info.sha256
    assert store.size("run/stage/absent") is None
    with pytest.raises(StoreError, match="missing object"):
        store.get_bytes("run/stage/absent")
    store.delete("run/stage/blob.bin")
    store.delete("run/stage/blob.bin")  # deleting a missing object is not an error
    assert not store.exists("run/stage/blob.bin")


def test_multipart_upload_streams_parts(s3_store_uri: str, moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> None:
    # S3 (and moto) reject non-final parts under 5 MiB, so the smallest legal part size.
    monkeypatch.setattr(s3mod, "PART_SIZE", 5 << 20)
    store = open_store(s3_store_uri)
    data = os.urandom((5 << 20) * 2 + 12345)  # 3 parts, the last one short
    with store.writer("run/stage/big.bin") as w:
        for i in range(0, len(data), 1 << 20):  # writes smaller than a part
            w.write(data[i : i + (1 << 20)])
    assert w.info.size == len(data)
    assert w.info.sha256 == hashlib.sha256(data).hexdigest()
    head = moto_s3.client().head_object(Bucket=moto_s3.bucket, Key=_raw_key(s3_store_uri, "run/stage/big.bin"))
    assert head["ETag"].strip('"').endswith("-3")  # a multipart ETag names its part count
    assert store.get_bytes("run/stage/big.bin") == data


def test_failed_write_aborts_multipart_and_leaves_no_object(
    s3_store_uri: str, moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3mod, "PART_SIZE", 5 << 20)
    store = open_store(s3_store_uri)
    with pytest.raises(RuntimeError, match="producer died"):
        with store.writer("run/stage/half.bin") as w:
            w.write(os.urandom((5 << 20) + 10))  # one part already uploaded
            raise RuntimeError("producer died")
    assert not store.exists("run/stage/half.bin")
    uploads = moto_s3.client().list_multipart_uploads(Bucket=moto_s3.bucket, Prefix=_raw_key(s3_store_uri, ""))
    assert uploads.get("Uploads", []) == []


def test_listing_is_scoped_to_prefixes(s3_store_uri: str) -> None:
    store = open_store(s3_store_uri)
    for key in ["r1/vocab/a.json", "r1/vocab/sub/b.json", "r1/vocabulary/c.json", "r2/vocab/d.json"]:
        store.put_bytes(key, b"x")
    assert store.list("r1/vocab") == ["r1/vocab/a.json", "r1/vocab/sub/b.json"]
    assert store.list("r1/vocab/") == store.list("r1/vocab")
    assert store.list("r1/none") == []
    assert store.list("") == sorted(["r1/vocab/a.json", "r1/vocab/sub/b.json", "r1/vocabulary/c.json", "r2/vocab/d.json"])
    assert store.delete_prefix("r1/vocab") == 2
    assert store.list("r1") == ["r1/vocabulary/c.json"]


def test_listing_follows_continuation_pages(s3_store_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(s3_store_uri)
    for i in range(7):
        store.put_bytes(f"r/s/{i:02d}", b"")
    # Pages of 2 keys from the real server exercise the continuation-token loop without
    # writing 1,000+ objects.
    real = store.client.get_paginator

    class SmallPages:
        def __init__(self, name: str) -> None:
            self.inner = real(name)

        def paginate(self, **kw: object):
            return self.inner.paginate(**kw, PaginationConfig={"PageSize": 2})

    monkeypatch.setattr(store.client, "get_paginator", SmallPages)
    assert store.list("r/s") == [f"r/s/{i:02d}" for i in range(7)]


@pytest.mark.parametrize("key", ["../escape", "/abs/key", "a/../b", "a//b", "a/./b", "", "a\\b", "a/b c"])
def test_invalid_keys_are_rejected(s3_store_uri: str, key: str) -> None:
    store = open_store(s3_store_uri)
    with pytest.raises(StoreError, match="invalid object key"):
        store.put_bytes(key, b"x")
    with pytest.raises(StoreError, match="invalid object key"):
        store.size(key)


def test_wrong_credentials_are_one_clear_error(s3_store_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    store = open_store(s3_store_uri)
    with pytest.raises(StoreError, match="refused the credentials"):
        store.check()
    with pytest.raises(StoreError, match="refused the credentials"):
        store.put_bytes("run/stage/x", b"x")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    with pytest.raises(StoreError, match=r"refused the credentials \(InvalidAccessKeyId\)"):
        open_store(s3_store_uri).check()


def test_missing_bucket_is_named(s3_store_uri: str, moto_s3: MotoS3) -> None:
    store = open_store(f"s3://no-such-bucket-{os.getpid()}/p")
    with pytest.raises(StoreError, match="bucket no-such-bucket-.* does not exist"):
        store.check()


def test_unreachable_endpoint_fails_fast(s3_store_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    store = open_store(s3_store_uri)
    with pytest.raises(StoreError, match="cannot reach S3 endpoint"):
        store.check()


def test_get_file_downloads_atomically(s3_store_uri: str, tmp_path: Path) -> None:
    store = open_store(s3_store_uri)
    store.put_bytes("r/s/obj", b"payload")
    dest = store.get_file("r/s/obj", tmp_path / "down" / "obj")
    assert dest.read_bytes() == b"payload"
    with pytest.raises(StoreError, match="missing object"):
        store.get_file("r/s/absent", tmp_path / "down" / "absent")
    assert sorted(p.name for p in (tmp_path / "down").iterdir()) == ["obj"]  # no partial left


def test_rejected_completion_is_a_store_error_and_aborts(
    s3_store_uri: str, moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Parts under S3's 5 MiB minimum are refused when the upload completes (moto enforces
    # it like S3): the failure must surface as one StoreError, with the upload aborted.
    monkeypatch.setattr(s3mod, "PART_SIZE", 1 << 20)
    store = open_store(s3_store_uri)
    with pytest.raises(StoreError, match=r"writing s3://.*/r/s/small-parts: S3 error EntityTooSmall"):
        store.put_bytes("r/s/small-parts", os.urandom((1 << 20) * 2 + 5))
    assert not store.exists("r/s/small-parts")
    uploads = moto_s3.client().list_multipart_uploads(Bucket=moto_s3.bucket, Prefix=_raw_key(s3_store_uri, ""))
    assert uploads.get("Uploads", []) == []


def test_copy_is_server_side_and_conditional(s3_store_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(s3_store_uri)
    data = os.urandom(13 << 20)
    store.put_bytes("a/big", data)
    small = store.put_bytes("a/small", b"tiny")
    assert store.copy("a/small", "b/small", if_fingerprint=small.fingerprint).stat.size == 4
    monkeypatch.setattr(s3mod, "COPY_MAX", 6 << 20)  # above it: UploadPartCopy, 5 MiB parts
    monkeypatch.setattr(s3mod, "COPY_PART", 5 << 20)
    seen = store.stat("a/big").fingerprint
    copied = store.copy("a/big", "b/big", if_fingerprint=seen)
    assert copied.source_fingerprint == seen and copied.stat == store.stat("b/big")
    assert store.sha256("b/big") == hashlib.sha256(data).hexdigest()
    store.delete("a/big")
    assert store.get_bytes("b/big") == data
    store.put_bytes("a/small", b"changed")
    with pytest.raises(StoreError, match="changed since it was checked"):
        store.copy("a/small", "c/small", if_fingerprint=small.fingerprint)
    with pytest.raises(StoreError, match="missing object"):
        store.copy("a/none", "c/none")
    assert store.list("c") == []
