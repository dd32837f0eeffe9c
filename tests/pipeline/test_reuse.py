"""``--reuse-from``: a run adopts another run's committed stages, and every way that could go wrong.

Stage outputs here are committed through the protocol (StageOutput, the input key every stage
computes, the stage config recorded) with made-up bytes: adoption never reads what objects
mean, only what the manifests say. Each run holds one object above SMALL_OBJECT (compared by
fingerprint on a skip) and small ones (re-hashed on every skip).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle3.config import load_config
from eagle3.contract import stage_input_key, upstream_digests
from eagle3.errors import ConfigError
from eagle3.manifest import SMALL_OBJECT, StageOutput, read_manifest, verify_stage
from eagle3.pipeline.reuse import reuse_stages
from eagle3.stages import ORDER, STAGES, stage_config
from eagle3.store import open_store
from eagle3.store.local import LocalStore
from tests.committed import put_required

REPO = Path(__file__).resolve().parents[2]
BIG = SMALL_OBJECT + 4096
OBJECTS = {
    "generate": {"tokenized.safetensors": b"t" * BIG, "metadata.json": b'{"samples": 3}\n',
                 "raw_responses.jsonl": b'{"id": 0}\n', "token_freq.safetensors": b"f" * 100},
    "vocab": {"vocab_mapping.safetensors": b"v" * 300},
    "extract": {"shards/shard-00000.safetensors": b"s" * BIG, "target_head.safetensors": b"h" * 200,
                "index.json": b'{"shards": [{"name": "shards/shard-00000.safetensors"}]}\n'},
    "train": {"drafter.safetensors": b"d" * 500, "checkpoints/step-0000001/state.json": b"{}"},
}


def small_objects(v) -> int:
    """How many of a verdict's objects a skip re-hashes every time (up to SMALL_OBJECT)."""
    return sum(o.size <= SMALL_OBJECT for o in v.manifest.manifest.objects)


def config(tmp_path: Path, run_id: str, uri: str | None = None, **over):
    return load_config(None, {"store.uri": uri or f"file://{tmp_path / 'store'}", "run_id": run_id, **over})


def commit(store, cfg, name: str, objects: dict[str, bytes] | None = None):
    """Commit a stage as run_stage would: its input key, its recorded config."""
    spec = STAGES[name]
    upstream = upstream_digests(cfg, spec, store)
    out = StageOutput(store, cfg.run_id, name, stage_input_key(cfg, spec, upstream, store),
                      {k: v.digest for k, v in upstream.items()}, config=stage_config(cfg, spec, store))
    out.begin()
    for key, data in (objects or OBJECTS[name]).items():
        out.put_bytes(key, data)
    put_required(out, name)
    return out.commit({"samples": 3, "made_by": cfg.run_id})


def run_a(tmp_path: Path, uri: str | None = None, **over):
    cfg = config(tmp_path, "run-a", uri, **over)
    store = open_store(cfg.store.uri)
    for name in ("generate", "vocab", "extract", "train"):
        commit(store, cfg, name)
    return cfg, store


def complete(store, cfg, name: str):
    spec = STAGES[name]
    return verify_stage(store, cfg.run_id, name, input_key=stage_input_key(cfg, spec, upstream_digests(cfg, spec, store), store))


def reuse(cfg, store, selected=frozenset(ORDER), source="run-a"):
    lines: list[str] = []
    adopted = reuse_stages(cfg, store, source, set(selected), echo=lines.append)
    return [a.stage for a in adopted], lines


def test_a_draft_vocab_sweep_adopts_generate_and_extract_and_runs_the_rest(tmp_path):
    a, store = run_a(tmp_path)
    b = config(tmp_path, "run-b", **{"vocab.draft_vocab_size": 64})
    adopted, lines = reuse(b, store)
    assert adopted == ["generate", "extract"]
    assert "vocab: not reused from run run-a: vocab.draft_vocab_size differs" in lines
    assert any(line.startswith("extract: adopted from run run-a into run run-b (3 objects") for line in lines)
    for name in ("generate", "extract"):
        v = complete(store, b, name)
        assert v.complete, v.reason
        mine, theirs = v.manifest.manifest, read_manifest(store, "run-a", name)
        assert mine.run_id == "run-b" and mine.prefix.startswith(f"run-b/{name}/attempt-")
        assert [(o.key, o.size, o.sha256) for o in mine.objects] == [(o.key, o.size, o.sha256) for o in theirs.manifest.objects]
        assert mine.stats == {**theirs.manifest.stats, "reused_from": {
            "run": "run-a", "stage": name, "manifest_digest": theirs.digest}}
        assert mine.stats["made_by"] == "run-a"
        assert mine.config == stage_config(b, STAGES[name], store)
    shard = "shards/shard-00000.safetensors"
    mine = read_manifest(store, "run-b", "extract").manifest
    theirs = read_manifest(store, "run-a", "extract").manifest
    assert store.local_path(mine.object_key(shard)).stat().st_ino == store.local_path(theirs.object_key(shard)).stat().st_ino
    # the link moved the shared inode's ctime: both runs' next skips still re-hash small objects only
    for cfg in (a, b):
        for name in ("generate", "extract"):
            v = complete(store, cfg, name)
            assert v.complete and v.rehashed == small_objects(v), (cfg.run_id, name, v.rehashed)
    assert not complete(store, b, "vocab").complete  # the scheduler runs it


def test_settings_that_change_nothing_adopt_the_whole_chain_and_a_rerun_adopts_nothing(tmp_path):
    run_a(tmp_path)
    store = open_store(f"file://{tmp_path / 'store'}")
    b = config(tmp_path, "run-b", **{"train.checkpoint_every": 7, "extract.batch_tokens": 999})  # volatile fields
    adopted, _ = reuse(b, store)
    assert adopted == ["generate", "vocab", "extract", "train"]
    assert complete(store, b, "train").complete
    assert reuse(b, store) == ([], [])  # complete already: nothing to say


def test_a_stage_after_one_rerun_here_is_adopted_only_if_that_rerun_made_the_same_bytes(tmp_path):
    run_a(tmp_path)
    store = open_store(f"file://{tmp_path / 'store'}")
    b = config(tmp_path, "run-b")
    assert reuse(b, store, {"generate", "extract"})[0] == ["generate", "extract"]
    commit(store, b, "vocab", {"vocab_mapping.safetensors": b"w" * 300})  # B's own vocab, other bytes
    adopted, lines = reuse(b, store)
    assert adopted == []
    assert lines == ["train: not reused from run run-a: this run's vocab differs from the vocab it was computed from"]
    commit(store, b, "vocab")  # byte for byte A's vocab, made by B
    assert reuse(b, store)[0] == ["train"]


@pytest.mark.parametrize("stage, field, value", [("extract", "extract.storage_dtype", "float8_e4m3fn"),
                                                  ("train", "train.lr", 1e-3), ("train", "drafter.hidden_size", 32)])
def test_a_hashed_setting_that_differs_is_never_adopted(tmp_path, stage, field, value):
    run_a(tmp_path)
    store = open_store(f"file://{tmp_path / 'store'}")
    adopted, lines = reuse(config(tmp_path, "run-b", **{field: value}), store)
    assert stage not in adopted and "generate" in adopted
    assert f"{stage}: not reused from run run-a: {field} differs" in lines


def test_other_code_is_never_adopted(tmp_path, monkeypatch):
    run_a(tmp_path)
    store = open_store(f"file://{tmp_path / 'store'}")
    monkeypatch.setattr("eagle3.pipeline.reuse.__version__", "99.0")
    adopted, lines = reuse(config(tmp_path, "run-b"), store)
    assert adopted == [] and lines[0].startswith("generate: not reused from run run-a: it was made by eagle3 ")


@pytest.mark.parametrize("name", ["metadata.json", "tokenized.safetensors"])
def test_a_corrupted_object_of_the_source_is_refused_and_nothing_is_copied(tmp_path, name):
    run_a(tmp_path)
    store = LocalStore(tmp_path / "store")
    path = store.local_path(read_manifest(store, "run-a", "generate").manifest.object_key(name))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    with open(path, "r+b") as f:  # in place, same size: only the content digest can tell
        f.write(data)
    adopted, lines = reuse(config(tmp_path, "run-b"), store)
    assert adopted == []
    key = read_manifest(store, "run-a", "generate").manifest.object_key(name)
    why = f"run run-a's generate does not verify: corrupted object {store.uri}/{key}: sha256 differs from the manifest"
    assert lines == [f"generate: not reused from run run-a: {why}"]
    assert store.list("run-b") == []


def test_a_source_rewritten_after_its_check_is_not_copied(tmp_path, monkeypatch):
    run_a(tmp_path)
    store = LocalStore(tmp_path / "store")
    copy = LocalStore.copy

    def rewrite_then_copy(self, src, dst, if_fingerprint=None):
        if src.endswith("tokenized.safetensors"):
            self.local_path(src).write_bytes(b"X" * BIG)  # between the verify and the copy
        return copy(self, src, dst, if_fingerprint)

    monkeypatch.setattr(LocalStore, "copy", rewrite_then_copy)
    adopted, lines = reuse(config(tmp_path, "run-b"), store)
    assert adopted == [] and "copying failed" in lines[0] and "changed since it was checked" in lines[0]
    assert read_manifest(store, "run-b", "generate") is None


KILL_SCRIPT = """
import os, signal, sys
from eagle3.config import load_config
from eagle3.pipeline import reuse
from eagle3.store import open_store
from eagle3.store.local import LocalStore

reuse.COPY_THREADS = 1  # the first copy is journaled before the second starts
copy, calls = LocalStore.copy, []
def copy_then_die(self, src, dst, if_fingerprint=None):
    calls.append(src)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-adoption: one object copied and journaled
    return copy(self, src, dst, if_fingerprint)
LocalStore.copy = copy_then_die
cfg = load_config(None, {"store.uri": sys.argv[1], "run_id": "run-b"})
reuse.reuse_stages(cfg, open_store(cfg.store.uri), "run-a", {"generate"})
"""


def test_a_kill_mid_adoption_commits_nothing_and_the_next_adoption_finishes_it(tmp_path, monkeypatch):
    run_a(tmp_path)
    uri = f"file://{tmp_path / 'store'}"
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(KILL_SCRIPT), uri], cwd=tmp_path, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert r.returncode == -9, r.stderr.decode()[-2000:]
    store = open_store(uri)
    b = config(tmp_path, "run-b")
    assert read_manifest(store, "run-b", "generate") is None and not complete(store, b, "generate").complete
    assert any("/_journal/" in k for k in store.list("run-b/generate"))  # the copy made before the kill
    copied = []
    copy = LocalStore.copy
    monkeypatch.setattr(LocalStore, "copy", lambda self, src, dst, if_fingerprint=None: copied.append(src) or copy(self, src, dst, if_fingerprint))
    assert reuse(b, store, {"generate"})[0] == ["generate"]
    assert len(copied) == len(OBJECTS["generate"]) - 1  # the object copied before the kill was kept
    v = verify_stage(store, "run-b", "generate", deep=True)
    assert v.complete, v.reason


def test_the_source_rerun_or_removed_later_never_breaks_the_adopted_copy(tmp_path):
    a, store = run_a(tmp_path)
    b = config(tmp_path, "run-b")
    reuse(b, store, {"generate"})
    commit(store, a, "generate", {**OBJECTS["generate"], "metadata.json": b'{"samples": 4}\n'})  # A rerun: old attempt swept
    v = complete(store, b, "generate")
    assert v.complete and v.rehashed == small_objects(v) + 1  # A's unlink moved the shared inode's ctime: once
    assert complete(store, b, "generate").rehashed == small_objects(v)
    store.delete_prefix("run-a")
    v = verify_stage(store, "run-b", "generate", deep=True)
    assert v.complete, v.reason


def test_adoption_on_s3_copies_server_side_and_survives_the_source(tmp_path, s3_store_uri, monkeypatch):
    monkeypatch.setattr("eagle3.store.s3.COPY_MAX", 6 << 20)  # the shards go part by part
    monkeypatch.setattr("eagle3.store.s3.COPY_PART", 5 << 20)
    _, store = run_a(tmp_path, s3_store_uri)
    b = config(tmp_path, "run-b", s3_store_uri, **{"vocab.draft_vocab_size": 64})
    adopted, _ = reuse(b, store)
    assert adopted == ["generate", "extract"]
    v = complete(store, b, "extract")
    assert v.rehashed == small_objects(v)  # the shard is trusted by its ETag
    store.delete_prefix("run-a")
    for name in adopted:
        v = verify_stage(store, "run-b", name, deep=True)
        assert v.complete, v.reason


def test_naming_no_run_or_this_run_is_one_clear_error(tmp_path):
    run_a(tmp_path)
    store = open_store(f"file://{tmp_path / 'store'}")
    b = config(tmp_path, "run-b")
    with pytest.raises(ConfigError, match=r"^--reuse-from run-c: run run-c has no committed stage in file://"):
        reuse(b, store, source="run-c")
    with pytest.raises(ConfigError, match="that is this run"):
        reuse(b, store, source="run-b")
    with pytest.raises(ConfigError, match="must be lowercase letters"):
        reuse(b, store, source="Run_A")


def test_the_pipeline_adopts_before_it_schedules_and_the_cli_passes_the_run(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from eagle3.cli.app import app
    from eagle3.pipeline.runner import run_pipeline
    from eagle3.pipeline.scheduler import Selection
    from tests.pipeline.fakes import FakeBackend

    run_a(tmp_path)
    monkeypatch.chdir(tmp_path)
    b = config(tmp_path, "run-b", **{"vocab.draft_vocab_size": 64})
    backends = []
    lines: list[str] = []
    run = run_pipeline(b, Selection(until=("extract",)), lines.append,
                       lambda cfg, state: backends.append(FakeBackend(cfg, open_store(cfg.store.uri))) or backends[-1],
                       poll_interval=0.01, reuse_from="run-a")
    assert run.result.ok and backends[0].submitted == []
    assert [run.result.rows[n].state for n in ("generate", "extract")] == ["skipped", "skipped"]
    assert lines[0].startswith("generate: adopted from run run-a into run run-b")

    store = f"file://{tmp_path / 'store'}"
    result = CliRunner().invoke(app, ["run", "pipeline", "--run-id", "run-c", "--store", store, "--reuse-from", "run-x"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == f"error: --reuse-from run-x: run run-x has no committed stage in {store}"
    seen = {}

    def fake_run(cfg, selection, echo, **kw):
        seen.update(kw, only=selection.only)
        raise KeyboardInterrupt

    monkeypatch.setattr("eagle3.pipeline.runner.run_pipeline", fake_run)
    for argv in (["run", "pipeline"], ["run", "stage", "extract"]):
        CliRunner().invoke(app, argv + ["--run-id", "run-c", "--store", store, "--reuse-from", "run-a"])
        assert seen["reuse_from"] == "run-a"
