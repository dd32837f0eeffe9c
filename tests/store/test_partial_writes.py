"""Writes begun and never finished: a killed writer's hidden file (disk) or unfinished upload (S3)
is never an object, is listed by ``partial_writes`` with when it was last written, and goes with
``remove_partial``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eagle3.store import open_store, stale_partial_writes

KILLED_WRITER = """
import os, signal, sys
import eagle3.store.s3 as s3
from eagle3.store import open_store
s3.PART_SIZE = 1024  # the first part goes up before the kill: an unfinished multipart upload
store = open_store(sys.argv[1])
with store.writer("r1/vocab/manifest.json") as w:
    w.write(b"x" * 3000)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}" if request.param == "file" else request.getfixturevalue("s3_store_uri")


def _kill_a_writer(uri: str) -> None:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_WRITER), uri], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == -9, r.stderr


def test_a_killed_writer_leaves_a_partial_write_that_is_listed_and_removed(uri: str) -> None:
    store = open_store(uri)
    store.put_bytes("r1/vocab/done.json", b"{}")
    store.put_bytes("r2/vocab/other.json", b"{}")
    t0 = time.time()
    _kill_a_writer(uri)
    assert store.list("r1") == ["r1/vocab/done.json"] and not store.exists("r1/vocab/manifest.json")
    (p,) = store.partial_writes("r1")
    assert p.key == "r1/vocab/manifest.json" and t0 - 5 < p.written_at <= time.time() + 5
    assert store.partial_writes("r2") == [] and store.partial_writes("r1/train") == []
    assert stale_partial_writes(store, "r1", idle_s=60) == []  # written just now: maybe a live writer
    assert stale_partial_writes(store, "r1", idle_s=60, now=time.time() + 61) == [p]
    store.remove_partial(p)
    assert store.partial_writes("r1") == [] and store.list("r1") == ["r1/vocab/done.json"]
    store.remove_partial(p)  # already gone: nothing to do


def test_lock_files_and_objects_are_not_partial_writes(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}")
    assert store.create_exclusive("r1/_run/lease.json", b"{}") is not None  # leaves a .lease.json.lock beside it
    assert any(n.endswith(".lock") for n in os.listdir(tmp_path / "r1" / "_run"))
    assert store.partial_writes("r1") == [] and store.partial_writes("") == []
