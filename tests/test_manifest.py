"""The manifest protocol: commit last, input keys, journaled resume, verification."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import eagle3.manifest as manifest_mod
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
from tests.committed import flip_in_place

KEY_A = compute_input_key("extract", {"extract": {"shard_tokens": 1}}, {"generate": "d1"})
KEY_B = compute_input_key("extract", {"extract": {"shard_tokens": 2}}, {"generate": "d1"})


def _kill_mid_stage(store_root: Path, n_written: int) -> None:
    """A real process that writes n objects through StageOutput, then is SIGKILLed before commit."""
    script = textwrap.dedent(f"""
        import os, signal
        from eagle3.manifest import StageOutput
        from eagle3.store.local import LocalStore
        out = StageOutput(LocalStore(__import__("pathlib").Path({str(store_root)!r})), "r1", "sharded", {KEY_A!r}, {{"generate": "d1"}})
        out.begin()
        for i in range({n_written}):
            out.put_bytes(f"shards/shard-{{i:06d}}.bin", bytes([i]) * (100 + i))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == -9, r.stderr


def test_key_is_deterministic_and_sensitive() -> None:
    assert compute_input_key("s", {"a": 1, "b": 2}, {}) == compute_input_key("s", {"b": 2, "a": 1}, {})
    assert KEY_A != KEY_B
    assert compute_input_key("s", {}, {"generate": "d1"}) != compute_input_key("s", {}, {"generate": "d2"})
    assert compute_input_key("s", {}, {}, code_version="1") != compute_input_key("s", {}, {}, code_version="2")


ROOT_A = f"attempt-{KEY_A[:12]}"
ROOT_B = f"attempt-{KEY_B[:12]}"


def test_commit_lists_objects_with_sha256(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    out = StageOutput(store, "r1", "small", KEY_A, {"generate": "d1"})
    out.begin()
    out.put_bytes("a.bin", b"hello")
    out.put_json("stats.json", {"x": 1})
    loaded = out.commit({"coverage": 0.9})
    m = loaded.manifest
    assert [o.key for o in m.objects] == ["a.bin", "stats.json"]
    assert m.object("a.bin").sha256 == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert m.object("a.bin").fingerprint  # the store's token, for cheap digest checks on every skip
    assert m.stats["coverage"] == 0.9 and "duration_s" in m.stats
    assert (m.stage, m.run_id, m.input_key, m.upstream, m.root) == ("small", "r1", KEY_A, {"generate": "d1"}, ROOT_A)
    assert m.object_key("a.bin") == f"r1/small/{ROOT_A}/a.bin"
    # Housekeeping after the commit: no journal or attempt file left behind.
    assert store.list("r1/small") == [f"r1/small/{ROOT_A}/a.bin", f"r1/small/{ROOT_A}/stats.json", "r1/small/manifest.json"]
    again = read_manifest(store, "r1", "small")
    assert again is not None and again.digest == loaded.digest
    with pytest.raises(ManifestError, match="lists no object 'absent'"):
        m.object("absent")
    assert verify_stage(store, "r1", "small", input_key=KEY_A, deep=True).complete


def test_kill_before_manifest_leaves_stage_incomplete_then_resumes(tmp_path: Path) -> None:
    _kill_mid_stage(tmp_path, n_written=3)
    store = LocalStore(tmp_path)
    v = verify_stage(store, "r1", "sharded", input_key=KEY_A)
    assert not v.complete and v.reason == f"no manifest at {store.uri}/r1/sharded/manifest.json"
    # Rerun with the same input key: the journal offers the finished objects.
    out = StageOutput(store, "r1", "sharded", KEY_A, {"generate": "d1"})
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
    assert verify_stage(store, "r1", "sharded", input_key=KEY_A, deep=True).complete


def test_changed_input_key_starts_beside_the_partial_attempt(tmp_path: Path) -> None:
    _kill_mid_stage(tmp_path, n_written=2)
    store = LocalStore(tmp_path)
    out = StageOutput(store, "r1", "sharded", KEY_B, {"generate": "d1"})
    out.begin()
    assert out.recovered() == {} and out.root == ROOT_B
    # KEY_A's partial attempt is kept (flip the setting back and it resumes) until a commit
    assert len(store.list(f"r1/sharded/{ROOT_A}/shards")) == 2
    out.put_bytes("x.bin", b"x")
    out.commit({})
    assert store.list("r1/sharded") == [f"r1/sharded/{ROOT_B}/x.bin", "r1/sharded/manifest.json"]


def test_journaled_object_altered_after_the_kill_is_not_recovered(tmp_path: Path) -> None:
    _kill_mid_stage(tmp_path, n_written=2)
    (tmp_path / f"r1/sharded/{ROOT_A}/shards/shard-000001.bin").write_bytes(b"short")
    store = LocalStore(tmp_path)
    out = StageOutput(store, "r1", "sharded", KEY_A, {"generate": "d1"})
    out.begin()
    assert list(out.recovered()) == ["shards/shard-000000.bin"]


@pytest.mark.parametrize("small_object", [manifest_mod.SMALL_OBJECT, 50])  # re-hashed always / by fingerprint
def test_a_same_size_edit_of_a_journaled_object_is_discarded_with_one_line(
        tmp_path: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, small_object: int) -> None:
    monkeypatch.setattr(manifest_mod, "SMALL_OBJECT", small_object)
    _kill_mid_stage(tmp_path, n_written=3)
    folder = tmp_path / f"r1/sharded/{ROOT_A}"
    flip_in_place(folder / "shards/shard-000001.bin", keep_mtime=True)
    (folder / "shards/shard-000009.bin").write_bytes(b"written as the attempt died, never journaled")
    (folder / "_journal/shards/shard-000002.bin.json").write_text("{not json")  # a journal cut short
    store = LocalStore(tmp_path)
    out = StageOutput(store, "r1", "sharded", KEY_A, {"generate": "d1"})
    out.begin()
    assert list(out.recovered()) == ["shards/shard-000000.bin"]
    err = capfd.readouterr().err.splitlines()
    assert err == [f"sharded: discarded shards/shard-000001.bin of the interrupted attempt (corrupted object "
                   f"{store.uri}/r1/sharded/{ROOT_A}/shards/shard-000001.bin: sha256 differs from the journal); "
                   "its work is done again"]
    # what the journal does not vouch for is gone; the next commit lists only what this attempt adopts or writes
    assert store.list(f"r1/sharded/{ROOT_A}") == [f"r1/sharded/{ROOT_A}/_attempt.json",
                                                  f"r1/sharded/{ROOT_A}/_journal/shards/shard-000000.bin.json",
                                                  f"r1/sharded/{ROOT_A}/shards/shard-000000.bin"]


def test_a_journal_whose_object_is_gone_is_dropped_quietly(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    _kill_mid_stage(tmp_path, n_written=2)
    (tmp_path / f"r1/sharded/{ROOT_A}/shards/shard-000001.bin").unlink()  # a drop() cut between its two deletes
    out = StageOutput(LocalStore(tmp_path), "r1", "sharded", KEY_A, {"generate": "d1"})
    out.begin()
    assert list(out.recovered()) == ["shards/shard-000000.bin"] and capfd.readouterr().err == ""
    assert not (tmp_path / f"r1/sharded/{ROOT_A}/_journal/shards/shard-000001.bin.json").exists()


def _commit(store: ObjectStore, key: str = KEY_A, objects: dict[str, bytes] | None = None, fresh: bool = False) -> StageOutput:
    out = StageOutput(store, "r1", "small", key, {})
    out.begin(fresh=fresh)
    for name, data in (objects or {"a.bin": b"1"}).items():
        out.put_bytes(name, data)
    out.commit({})
    return out


def test_a_rerun_never_uncommits_the_finished_output(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _commit(store, KEY_A)
    for key, fresh in ((KEY_B, False), (KEY_A, True)):  # a changed setting; a forced rerun
        again = StageOutput(store, "r1", "small", key, {})
        again.begin(fresh=fresh)
        again.put_bytes("a.bin", b"2")
        # the new attempt is under way (or dies here): the old output is still committed and intact
        v = verify_stage(store, "r1", "small", input_key=KEY_A, deep=True)
        assert v.complete and v.manifest is not None and v.manifest.manifest.root == ROOT_A
        assert again.root != ROOT_A
    # the forced attempt commits: it replaces the output, and only now is the old folder removed
    again.commit({})
    m = read_manifest(store, "r1", "small").manifest
    assert m.root == f"{ROOT_A}-b" and store.get_bytes(m.object_key("a.bin")) == b"2"
    assert not store.list(f"r1/small/{ROOT_A}") and not store.list(f"r1/small/{ROOT_B}")
    # forced once more: back to the first folder, never the committed one
    assert _commit(store, KEY_A, fresh=True).root == ROOT_A


def test_a_failing_attempt_leaves_the_committed_output_verified(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _commit(store, KEY_A, {"a.bin": b"old"})
    with pytest.raises(RuntimeError):
        out = StageOutput(store, "r1", "small", KEY_B, {})
        out.begin()
        with out.writer("a.bin") as w:
            w.write(b"new but unfinished")
            raise RuntimeError("stage died")
    v = verify_stage(store, "r1", "small", input_key=KEY_A, deep=True)
    assert v.complete and store.get_bytes(v.manifest.manifest.object_key("a.bin")) == b"old"


def test_input_key_mismatch_is_incomplete(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _commit(store, KEY_A)
    v = verify_stage(store, "r1", "small", input_key=KEY_B)
    assert not v.complete and v.reason == "r1/small: input key changed (config, upstream or code differ from the committed run)"
    assert verify_stage(store, "r1", "small", input_key=None).complete  # verify without a key: objects only


def _committed(store: ObjectStore) -> Path:
    """Commit a.bin (1000 bytes) and b.bin (10); the folder they are in (ROOT_A, or its twin
    when ROOT_A was the committed output already)."""
    out = _commit(store, KEY_A, {"a.bin": b"a" * 1000, "b.bin": b"b" * 10})
    return Path(store.local_path(out.prefix))  # type: ignore[arg-type]


def test_verify_names_missing_truncated_and_corrupted_objects(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    folder = _committed(store)
    (folder / "a.bin").write_bytes(b"a" * 999)
    (folder / "b.bin").unlink()
    v = verify_stage(store, "r1", "small")
    assert v.problems == [
        f"truncated or altered object {store.uri}/r1/small/{ROOT_A}/a.bin: 999 bytes, manifest says 1000",
        f"missing object {store.uri}/r1/small/{ROOT_A}/b.bin",
    ]
    folder = _committed(store)  # the damaged output is replaced (beside it: the twin folder)
    assert folder.name == f"{ROOT_A}-b"
    (folder / "a.bin").write_bytes(b"a" * 999 + b"X")  # same size, other bytes
    v = verify_stage(store, "r1", "small")  # no --deep needed: a small object is re-hashed on every check
    assert v.problems == [f"corrupted object {store.uri}/r1/small/{ROOT_A}-b/a.bin: sha256 differs from the manifest"]


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_large_objects_are_checked_by_fingerprint_and_a_byte_flip_is_caught(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep_mtime: bool) -> None:
    monkeypatch.setattr(manifest_mod, "SMALL_OBJECT", 100)
    store = LocalStore(tmp_path)
    folder = _committed(store)
    v = verify_stage(store, "r1", "small")
    assert v.complete and v.rehashed == 1  # b.bin (10 bytes) re-hashed; a.bin by its fingerprint alone
    time.sleep(0.01)
    flip_in_place(folder / "a.bin", keep_mtime)
    v = verify_stage(store, "r1", "small")
    assert v.problems == [f"corrupted object {store.uri}/r1/small/{ROOT_A}/a.bin: sha256 differs from the manifest"]


def test_a_copied_store_is_re_hashed_once_then_cheap_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_mod, "SMALL_OBJECT", 100)
    _committed(LocalStore(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # new inodes: fingerprints no longer match
    copy = LocalStore(tmp_path / "b")
    first = verify_stage(copy, "r1", "small")
    assert first.complete and first.rehashed == 2
    second = verify_stage(copy, "r1", "small")
    assert second.complete and second.rehashed == 1  # the fingerprint cache spares a.bin now
    flip_in_place(tmp_path / f"b/r1/small/{ROOT_A}/a.bin", keep_mtime=True)  # now with the cached fingerprint
    assert not verify_stage(copy, "r1", "small").complete


def test_schema_1_manifests_still_verify(tmp_path: Path) -> None:
    """Runs committed before attempt folders: objects directly under the stage prefix."""
    store = LocalStore(tmp_path)
    store.put_bytes("r1/small/a.bin", b"hello")
    legacy = {"schema_version": 1, "stage": "small", "run_id": "r1", "input_key": KEY_A, "code_version": "0.1.0",
              "upstream": {}, "stats": {}, "started_at": "x", "finished_at": "y",
              "objects": [{"key": "a.bin", "size": 5, "sha256": hashlib.sha256(b"hello").hexdigest()}]}
    store.put_bytes("r1/small/manifest.json", json.dumps(legacy).encode())
    v = verify_stage(store, "r1", "small", input_key=KEY_A, deep=True)
    assert v.complete and v.manifest.manifest.object_key("a.bin") == "r1/small/a.bin"
    _commit(store, KEY_B)  # the replacement sweeps the old layout's objects
    assert store.list("r1/small") == [f"r1/small/{ROOT_B}/a.bin", "r1/small/manifest.json"]


def test_content_check_runs_only_when_objects_are_intact(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _committed(store)
    calls = []

    def check(s: ObjectStore, m: object) -> list[str]:
        calls.append(m)
        return ["b.bin holds 10 b's, expected 11"]

    v = verify_stage(store, "r1", "small", deep=True, content_check=check)
    assert v.problems == ["b.bin holds 10 b's, expected 11"] and len(calls) == 1
    assert verify_stage(store, "r1", "small", deep=False, content_check=check).complete and len(calls) == 1


def test_unparsable_or_foreign_manifests(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _committed(store)
    raw = json.loads((tmp_path / "r1/small/manifest.json").read_text())
    (tmp_path / "r1/small/manifest.json").write_text("{not json")
    v = verify_stage(store, "r1", "small")
    assert v.problems == [f"manifest {store.uri}/r1/small/manifest.json does not parse"]
    (tmp_path / "r1/small/manifest.json").write_text(json.dumps({**raw, "schema_version": 99}))
    assert "schema version 99, expected 2" in verify_stage(store, "r1", "small").reason
    (tmp_path / "r1/small/manifest.json").write_text(json.dumps({**raw, "stage": "train"}))
    assert verify_stage(store, "r1", "small").reason == "manifest at r1/small names r1/train"


def test_reserved_names_and_drop(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}")
    out = StageOutput(store, "r1", "train", KEY_A, {})
    out.begin()
    for name in ("manifest.json", "_attempt.json", "_journal/x.json", "_verified.json"):
        with pytest.raises(ManifestError, match="reserved"):
            out.put_bytes(name, b"x")
    out.put_bytes("part-0.bin", b"x")
    out.put_bytes("final.bin", b"xy")
    out.drop("part-0.bin")
    m = out.commit({}).manifest
    assert m.keys() == ["final.bin"] and not store.exists(f"r1/train/{ROOT_A}/part-0.bin")


@pytest.mark.s3
def test_resume_on_s3(s3_store_uri: str) -> None:
    store = open_store(s3_store_uri)
    out = StageOutput(store, "r1", "sharded", KEY_A, {})
    out.begin()
    out.put_bytes("shards/0.bin", b"0" * 10)
    out.put_bytes("shards/1.bin", b"1" * 10)
    # No commit: the process "died". A new attempt with the same key recovers both.
    again = StageOutput(store, "r1", "sharded", KEY_A, {})
    again.begin()
    assert list(again.recovered()) == ["shards/0.bin", "shards/1.bin"]
    for name in again.recovered():
        again.adopt(name)
    again.commit({})
    assert verify_stage(store, "r1", "sharded", input_key=KEY_A, deep=True).complete
    assert store.list("r1/sharded") == [f"r1/sharded/{ROOT_A}/shards/0.bin", f"r1/sharded/{ROOT_A}/shards/1.bin",
                                        "r1/sharded/manifest.json"]


@pytest.mark.s3
def test_resume_on_s3_discards_a_journaled_object_rewritten_at_the_same_size(
        s3_store_uri: str, moto_s3, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(manifest_mod, "SMALL_OBJECT", 5)  # trusted by ETag unless the ETag moved
    store = open_store(s3_store_uri)
    out = StageOutput(store, "r1", "sharded", KEY_A, {})
    out.begin()
    out.put_bytes("shards/0.bin", b"0" * 10)
    out.put_bytes("shards/1.bin", b"1" * 10)
    raw = f"{s3_store_uri.split('/', 3)[3]}/r1/sharded/{ROOT_A}/shards/1.bin"
    moto_s3.client().put_object(Bucket=moto_s3.bucket, Key=raw, Body=b"1" * 9 + b"X")
    again = StageOutput(store, "r1", "sharded", KEY_A, {})
    again.begin()
    assert list(again.recovered()) == ["shards/0.bin"]
    assert "discarded shards/1.bin of the interrupted attempt (corrupted object" in capfd.readouterr().err
    assert not store.exists(f"r1/sharded/{ROOT_A}/shards/1.bin")


@pytest.mark.s3
def test_s3_same_size_rewrite_is_caught_by_its_etag(s3_store_uri: str, moto_s3, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_mod, "SMALL_OBJECT", 100)
    store = open_store(s3_store_uri)
    _commit(store, KEY_A, {"a.bin": b"a" * 1000})
    v = verify_stage(store, "r1", "small")
    assert v.complete and v.rehashed == 0  # one LIST: size and ETag, nothing read back
    raw = f"{s3_store_uri.split('/', 3)[3]}/r1/small/{ROOT_A}/a.bin"
    moto_s3.client().put_object(Bucket=moto_s3.bucket, Key=raw, Body=b"a" * 999 + b"X")
    assert verify_stage(store, "r1", "small").problems == [
        f"corrupted object {s3_store_uri}/r1/small/{ROOT_A}/a.bin: sha256 differs from the manifest"]
