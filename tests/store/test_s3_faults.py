"""S3Store through a fault-injecting proxy: 500s, 503s and bodies cut mid-stream are ridden out."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import pytest

from eagle3.errors import StoreError
from eagle3.store import open_store
from eagle3.store import s3 as s3mod
from tests.fault_proxy import FaultProxy
from tests.fixtures_s3 import MotoS3

pytestmark = pytest.mark.s3


@pytest.fixture
def proxy(moto_s3: MotoS3, s3_store_uri: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    with FaultProxy(moto_s3.endpoint, rate=0.0) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        yield p


def test_two_faults_in_a_row_at_start_up_do_not_fail_the_check(s3_store_uri: str, proxy: FaultProxy) -> None:
    proxy.scripted = ["503", "500", "503"]
    open_store(s3_store_uri).check()
    assert proxy.counts["faults"] == 3


def test_the_attempt_budget_is_a_setting_and_exhausting_it_is_one_line(s3_store_uri: str, proxy: FaultProxy) -> None:
    proxy.scripted = ["503"] * 3
    with pytest.raises(StoreError, match=r"^store s3://.*: S3 error SlowDown"):
        open_store(s3_store_uri, max_attempts=3).check()


def test_cut_body_is_resumed_with_a_ranged_get(s3_store_uri: str, proxy: FaultProxy) -> None:
    store = open_store(s3_store_uri)
    data = os.urandom(300_000)
    store.put_bytes("r/s/blob", data)
    proxy.scripted = ["cut", "cut"]  # the GET is cut, then its first resume too
    assert store.get_bytes("r/s/blob") == data
    assert proxy.counts["cut"] == 2


def test_a_cut_completion_of_a_multipart_upload_is_recognised(s3_store_uri: str, proxy: FaultProxy,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The completion succeeds on the server, its answer is lost, botocore retries: NoSuchUpload.
    The object is there with the ETag its parts make, so the write stands."""
    monkeypatch.setattr(s3mod, "PART_SIZE", 5 << 20)
    store = open_store(s3_store_uri)
    proxy.only = ("POST",)  # create and complete are POSTs; parts are PUTs
    proxy.scripted = [None, "cut"]  # type: ignore[list-item]  # create passes; the completion's answer is cut
    data = os.urandom((5 << 20) + 1000)
    with store.writer("r/s/big") as w:
        w.write(data)
    assert proxy.counts["cut"] == 1
    assert w.info.sha256 == hashlib.sha256(data).hexdigest()
    assert store.stat("r/s/big").fingerprint == w.info.fingerprint
    assert store.get_bytes("r/s/big") == data


def test_a_conditional_create_whose_answer_was_lost_is_still_ours(s3_store_uri: str, proxy: FaultProxy) -> None:
    store = open_store(s3_store_uri)
    proxy.only = ("PUT",)
    proxy.scripted = ["cut"]  # created, answer cut, retried: 412 from our own object
    assert store.create_exclusive("r/_run/lease.json", b"owner-a") is not None
    assert store.create_exclusive("r/_run/lease.json", b"owner-b") is None


def test_random_faults_over_many_calls(s3_store_uri: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3mod, "PART_SIZE", 5 << 20)
    store = open_store(s3_store_uri)
    proxy.rate = 0.25
    blobs = {f"r/s/o{i}": os.urandom(1000 * (i + 1)) for i in range(20)}
    blobs["r/s/big"] = os.urandom(11 << 20)
    for k, v in blobs.items():
        store.put_bytes(k, v)
    assert sorted(store.list("r/s")) == sorted(blobs)
    for k, v in blobs.items():
        assert store.get_bytes(k) == v and store.size(k) == len(v)
    store.delete_prefix("r/s")
    assert store.list("r/s") == []
    assert proxy.counts["faults"] >= 10, proxy.counts
