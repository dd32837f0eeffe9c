"""The manifest protocol: commit last, input keys, journaled resume, verification."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle3.errors import ManifestError
from eagle3.manifest import (
    StageOutput,
    compute_input_key,
    read_manifest,
    verify_stage,
)
from eagle3.store import open_store
from eagle3.store.base import ObjectStore
from eagle3.store.local import LocalStore

KEY_A = compute_input_key("extract", {"extract": {"shard_tokens": 1}}, {"generate": "d1"})
KEY_B = compute_input_key("extract", {"extract": {"shard_tokens": 2}}, {"generate": "d1"})


def _kill_mid_stage(store_root: Path, n_written: int) -> None:
    """A real process that writes n objects through StageOutput, then is SIGKILLed before commit."""
    script = textwrap.dedent(f"""
        import os, signal
        from eagle3.manifest import StageOutput
        from eagle3.store.local import LocalStore
        out = StageOutput(LocalStore(__import__("pathlib").Path({str(store_root)!r})), "r1", "extract", {KEY_A!r}, {{"generate": "d1"}})
        out.begin()
        for i in range({n_written}):
            out.put_bytes(f"shards/shard-{{i:06d}}.bin", bytes([i]) * (100 + i))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == -9, r.stderr


def test_key_is_deterministic_and_sensitive() -> None:
    assert compute_input_key("s", {"a": 1, "b": 2}, {}) == compute_input_key("s", {"b": 2, "a": 1}, {})
    assert KEY_A != KEY_B
    assert compute_input_key("s", {}, {"generate": "d1"}) != compute_input_key("s", {}, {"generate": "d2"})
    assert compute_input_key("s", {}, {}, code_version="1") != compute_input_key("s", {}, {}, code_version="2")


def test_commit_lists_objects_with_sha256(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    out = StageOutput(store, "r1", "vocab", KEY_A, {"generate": "d1"})
    out.begin()
    out.put_bytes("a.bin", b"hello")
    out.put_json("stats.json", {"x": 1})
    loaded = out.commit({"coverage": 0.9})
    m = loaded.manifest
    assert [o.key for o in m.objects] == ["a.bin", "stats.json"]
    assert m.object("a.bin").sha256 == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert m.stats["coverage"] == 0.9 and "duration_s" in m.stats
    assert (m.stage, m.run_id, m.input_key, m.upstream) == ("vocab", "r1", KEY_A, {"generate": "d1"})
    # Housekeeping after the commit: no journal or attempt file left behind.
    assert store.list("r1/vocab") == ["r1/vocab/a.bin", "r1/vocab/manifest.json", "r1/vocab/stats.json"]
    again = read_manifest(store, "r1", "vocab")
    assert again is not None and again.digest == loaded.digest
    with pytest.raises(ManifestError, match="lists no object 'absent'"):
        m.object("absent")
    assert verify_stage(store, "r1", "vocab", input_key=KEY_A, deep=True).complete


def test_kill_before_manifest_leaves_stage_incomplete_then_resumes(tmp_path: Path) -> None:
    _kill_mid_stage(tmp_path, n_written=3)
    store = LocalStore(tmp_path)
    v = verify_stage(store, "r1", "extract", input_key=KEY_A)
    assert not v.complete and v.reason == f"no manifest at {store.uri}/r1/extract/manifest.json"
    # Rerun with the same input key: the journal offers the finished objects.
    out = StageOutput(store, "r1", "extract", KEY_A, {"generate": "d1"})
    out.begin()
    recovered = out.recovered("shards/")
    assert list(recovered) == [f"shards/shard-{i:06d}.bin" for i in range(3)]
    assert recovered["shards/shard-000002.bin"].size == 102
    for name in recovered:
        out.adopt(name)
    for i in range(3, 5):  # only the missing shards are produced
        out.put_bytes(f"shards/shard-{i:06d}.bin", bytes([i]) * (100 + i))
    m = out.commit({}).manifest
    assert [o.key for o in m.objects] == [f"shards/shard-{i:06d}.bin" for i in range(5)]  # none lost, none twice
    assert verify_stage(store, "r1", "extract", input_key=KEY_A, deep=True).complete


def test_changed_input_key_wipes_partial_objects(tmp_path: Path) -> None:
    _kill_mid_stage(tmp_path, n_written=2)
    store = LocalStore(tmp_path)
    out = StageOutput(store, "r1", "extract", KEY_B, {"generate": "d1"})
    out.begin()
    assert out.recovered() == {}
    assert store.list("r1/extract") == ["r1/extract/_attempt.json"]


def test_journaled_object_altered_after_the_kill_is_not_recovered(tmp_path: Path) -> None:
    _kill_mid_stage(tmp_path, n_written=2)
    (tmp_path / "r1/extract/shards/shard-000001.bin").write_bytes(b"short")
    store = LocalStore(tmp_path)
    out = StageOutput(store, "r1", "extract", KEY_A, {"generate": "d1"})
    out.begin()
    assert list(out.recovered()) == ["shards/shard-000000.bin"]


def test_rerun_uncommits_before_writing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    out = StageOutput(store, "r1", "vocab", KEY_A, {})
    out.begin()
    out.put_bytes("a.bin", b"1")
    out.commit({})
    again = StageOutput(store, "r1", "vocab", KEY_A, {})
    again.begin()  # from here on the stage must not look complete
    assert not verify_stage(store, "r1", "vocab").complete


def test_input_key_mismatch_is_incomplete(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    out = StageOutput(store, "r1", "vocab", KEY_A, {})
    out.begin()
    out.put_bytes("a.bin", b"1")
    out.commit({})
    v = verify_stage(store, "r1", "vocab", input_key=KEY_B)
    assert not v.complete and v.reason == "r1/vocab: input key changed (config, upstream or code differ from the committed run)"
    assert verify_stage(store, "r1", "vocab", input_key=None).complete  # verify without a key: objects only


def _committed(store: ObjectStore) -> None:
    out = StageOutput(store, "r1", "vocab", KEY_A, {})
    out.begin()
    out.put_bytes("a.bin", b"a" * 1000)
    out.put_bytes("b.bin", b"b" * 10)
    out.commit({})


def test_verify_names_missing_truncated_and_corrupted_objects(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _committed(store)
    (tmp_path / "r1/vocab/a.bin").write_bytes(b"a" * 999)
    (tmp_path / "r1/vocab/b.bin").unlink()
    v = verify_stage(store, "r1", "vocab")
    assert v.problems == [
        f"truncated or altered object {store.uri}/r1/vocab/a.bin: 999 bytes, manifest says 1000",
        f"missing object {store.uri}/r1/vocab/b.bin",
    ]
    _committed(store)
    (tmp_path / "r1/vocab/a.bin").write_bytes(b"a" * 999 + b"X")  # same size, other bytes
    assert verify_stage(store, "r1", "vocab").complete  # shallow: sizes only
    v = verify_stage(store, "r1", "vocab", deep=True)
    assert v.problems == [f"corrupted object {store.uri}/r1/vocab/a.bin: sha256 differs from the manifest"]


def test_content_check_runs_only_when_objects_are_intact(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _committed(store)
    calls = []

    def check(s: ObjectStore, m: object) -> list[str]:
        calls.append(m)
        return ["b.bin holds 10 b's, expected 11"]

    v = verify_stage(store, "r1", "vocab", deep=True, content_check=check)
    assert v.problems == ["b.bin holds 10 b's, expected 11"] and len(calls) == 1
    assert verify_stage(store, "r1", "vocab", deep=False, content_check=check).complete and len(calls) == 1


def test_unparsable_or_foreign_manifests(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _committed(store)
    raw = json.loads((tmp_path / "r1/vocab/manifest.json").read_text())
    (tmp_path / "r1/vocab/manifest.json").write_text("{not json")
    v = verify_stage(store, "r1", "vocab")
    assert v.problems == [f"manifest {store.uri}/r1/vocab/manifest.json does not parse"]
    (tmp_path / "r1/vocab/manifest.json").write_text(json.dumps({**raw, "schema_version": 99}))
    assert "schema version 99, expected 1" in verify_stage(store, "r1", "vocab").reason
    (tmp_path / "r1/vocab/manifest.json").write_text(json.dumps({**raw, "stage": "train"}))
    assert verify_stage(store, "r1", "vocab").reason == "manifest at r1/vocab names r1/train"


def test_reserved_names_and_drop(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}")
    out = StageOutput(store, "r1", "train", KEY_A, {})
    out.begin()
    for name in ("manifest.json", "_attempt.json", "_journal/x.json"):
        with pytest.raises(ManifestError, match="reserved"):
            out.put_bytes(name, b"x")
    out.put_bytes("part-0.bin", b"x")
    out.put_bytes("final.bin", b"xy")
    out.drop("part-0.bin")
    m = out.commit({}).manifest
    assert m.keys() == ["final.bin"] and not store.exists("r1/train/part-0.bin")


@pytest.mark.s3
def test_resume_on_s3(s3_store_uri: str) -> None:
    store = open_store(s3_store_uri)
    out = StageOutput(store, "r1", "extract", KEY_A, {})
    out.begin()
    out.put_bytes("shards/0.bin", b"0" * 10)
    out.put_bytes("shards/1.bin", b"1" * 10)
    # No commit: the process "died". A new attempt with the same key recovers both.
    again = StageOutput(store, "r1", "extract", KEY_A, {})
    again.begin()
    assert list(again.recovered()) == ["shards/0.bin", "shards/1.bin"]
    for name in again.recovered():
        again.adopt(name)
    again.commit({})
    assert verify_stage(store, "r1", "extract", input_key=KEY_A, deep=True).complete
    assert store.list("r1/extract") == ["r1/extract/manifest.json", "r1/extract/shards/0.bin", "r1/extract/shards/1.bin"]
