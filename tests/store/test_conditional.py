"""Conditional writes, the lease's primitives, on both stores: racing writers, exactly one wins."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from eagle3.store import ObjectStore, open_store


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return open_store(f"file://{tmp_path}")
    return open_store(request.getfixturevalue("s3_store_uri"))


def test_create_exclusive_has_one_winner_among_racing_threads(store: ObjectStore) -> None:
    wins: list[bytes] = []
    barrier = threading.Barrier(8)

    def take(i: int) -> None:
        barrier.wait()
        data = f"owner-{i}".encode()
        if store.create_exclusive("r/_run/lease.json", data) is not None:
            wins.append(data)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert store.get_bytes("r/_run/lease.json") == wins[0]  # the winner's bytes, whole
    assert store.list("r/_run") == ["r/_run/lease.json"]  # no temp or lock file shows as an object


def test_replace_if_and_delete_if_compare_versions(store: ObjectStore) -> None:
    v1 = store.create_exclusive("k", b"one")
    assert v1 is not None and store.create_exclusive("k", b"two") is None
    got = store.get_versioned("k")
    assert got == (b"one", v1)
    v2 = store.replace_if("k", b"two", v1)
    assert v2 is not None and v2 != v1
    assert store.replace_if("k", b"three", v1) is None  # a stale version loses
    assert store.get_bytes("k") == b"two"
    assert store.delete_if("k", v1) is False  # stale: kept
    assert store.exists("k")
    assert store.delete_if("k", v2) is True
    assert not store.exists("k")
    assert store.delete_if("k", v2) is True  # gone either way
    assert store.replace_if("k", b"x", v2) is None  # nothing to replace
    assert store.get_versioned("k") is None


def test_compare_and_swap_under_contention_loses_no_increment(store: ObjectStore) -> None:
    store.create_exclusive("counter", b"0 -")

    def bump(who: int, n: int) -> None:
        done = 0
        while done < n:
            data, version = store.get_versioned("counter")  # type: ignore[misc]
            # writers put their own token in what they write (the lease does: its owner), so a
            # retried write that finds its own bytes knows them from another writer's
            new = f"{int(data.split()[0]) + 1} {who}-{done}".encode()
            if store.replace_if("counter", new, version) is not None:
                done += 1

    threads = [threading.Thread(target=bump, args=(i, 5)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.get_bytes("counter").split()[0] == b"20"


def test_stat_prefix_gives_size_and_fingerprint_of_every_object(store: ObjectStore) -> None:
    a = store.put_bytes("r/s/a.bin", b"aaaa")
    store.put_bytes("r/s/sub/b.bin", b"bb")
    store.put_bytes("r/other/c.bin", b"c")
    stats = store.stat_prefix("r/s")
    assert sorted(stats) == ["r/s/a.bin", "r/s/sub/b.bin"]
    assert stats["r/s/a.bin"].size == 4 and stats["r/s/a.bin"].fingerprint == a.fingerprint
    assert store.stat("r/s/a.bin") == stats["r/s/a.bin"]
    store.put_bytes("r/s/a.bin", b"AAAA")  # rewritten, same size
    assert store.stat("r/s/a.bin").fingerprint != a.fingerprint
    assert store.stat("r/s/absent") is None and store.stat_prefix("r/none") == {}
    assert store.has_prefix("r/s") and not store.has_prefix("r/none")
