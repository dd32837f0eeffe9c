"""The vocab stage end to end through ``eagle3 stage vocab`` on a fabricated generate stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from typer.testing import CliRunner, Result

from eagle3.cli.app import app
from eagle3.cli.stage import app as stage_app
from eagle3.config import load_config
from eagle3.manifest import StageOutput, read_manifest, verify_stage
from eagle3.store import open_store
from eagle3.vocab.mapping import build_vocab_mapping, coverage, draft_to_target
from eagle3.vocab.stage import deep_check
from tests.fabricated_upstream import commit_fabricated_generate
from tests.committed import key_of

V = 1000
N = 100


def _eagle3(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "eagle3", *args], capture_output=True, text=True, env=env or os.environ.copy()
    )


def _eagle3_in_process(*args: str, env: dict[str, str] | None = None) -> Result:
    """``eagle3 stage …`` through the same typer app, without a new interpreter."""
    return CliRunner().invoke(stage_app, list(args), env=env)


def _eagle3ctl(*args: str) -> Result:
    """The user's command, in-process (the stage entrypoint above runs as a real subprocess)."""
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def fabricated_generate(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    """A file:// store with a committed, fabricated generate stage; returns (config path, counts)."""
    cfg_path = tmp_path / "pipeline.yaml"
    cfg_path.write_text(f"run_id: r1\nstore:\n  uri: file://{tmp_path / 'store'}\nvocab:\n  draft_vocab_size: {N}\n")
    cfg = load_config(cfg_path)
    store = open_store(cfg.store.uri)
    commit_fabricated_generate(store, cfg, vocab_size=V)
    counts = load_bytes(store.get_bytes(key_of(store, 'r1', "generate", 'token_freq.safetensors')))["counts"]
    return cfg_path, counts


def test_stage_commits_mapping_and_coverage(fabricated_generate: tuple[Path, torch.Tensor]) -> None:
    cfg_path, counts = fabricated_generate
    r = _eagle3("stage", "vocab", "-c", str(cfg_path))
    assert r.returncode == 0, r.stderr
    assert "EAGLE3_PROGRESS" in r.stderr and "stage vocab: committed" in r.stderr
    cfg = load_config(cfg_path)
    store = open_store(cfg.store.uri)
    m = read_manifest(store, "r1", "vocab")
    assert m is not None
    assert m.manifest.keys() == ["coverage.json", "coverage.png", "vocab_mapping.safetensors"]
    tensors = load_bytes(store.get_bytes(key_of(store, 'r1', "vocab", 'vocab_mapping.safetensors')))
    want_d2t, want_t2d = build_vocab_mapping(counts, N)
    assert torch.equal(tensors["d2t"], want_d2t) and torch.equal(tensors["t2d"], want_t2d)
    report = json.loads(store.get_bytes(key_of(store, 'r1', "vocab", 'coverage.json')))
    assert report["coverage"] == pytest.approx(coverage(counts, want_t2d), abs=1e-6)
    assert report["coverage"] == m.manifest.stats["coverage"]
    assert report["distinct_tokens_seen"] == int((counts > 0).sum())
    assert report["tokens_counted"] == int(counts.sum())
    assert (report["draft_vocab_size"], report["target_vocab_size"]) == (N, V)
    curve = {p["draft_vocab_size"]: p["coverage"] for p in report["coverage_curve"]}
    assert curve[N] == report["coverage"] and curve[V] == pytest.approx(1.0)
    assert store.get_bytes(key_of(store, 'r1', "vocab", 'coverage.png'))[:8] == b"\x89PNG\r\n\x1a\n"
    # Verified deep (sha256 + content check) by the user's command; a rerun skips.
    r = _eagle3ctl("verify", "-c", str(cfg_path), "--stage", "vocab", "--deep")
    assert r.exit_code == 0 and "vocab: ok (3 objects, deep)" in r.stdout, r.output
    r = _eagle3_in_process("stage", "vocab", "-c", str(cfg_path))
    assert r.exit_code == 0 and "already complete" in r.output


def test_unseen_tokens_fill_the_vocab(tmp_path: Path) -> None:
    cfg = load_config(None, {"run_id": "r2", "store.uri": f"file://{tmp_path}", "vocab.draft_vocab_size": 8})
    store = open_store(cfg.store.uri)
    counts = torch.zeros(50, dtype=torch.int64)
    counts[[40, 7, 30]] = torch.tensor([3, 2, 1])
    commit_fabricated_generate(store, cfg, vocab_size=50, counts=counts)
    from eagle3.context import run_stage

    stats = run_stage(cfg, "vocab")
    assert stats is not None
    assert (stats["distinct_tokens_seen"], stats["unseen_filled"], stats["coverage"]) == (3, 5, 1.0)
    d2t = load_bytes(store.get_bytes(key_of(store, 'r2', "vocab", 'vocab_mapping.safetensors')))["d2t"]
    assert draft_to_target(d2t).tolist() == [0, 1, 2, 3, 4, 7, 30, 40]


def test_draft_vocab_larger_than_target_is_one_line_error(fabricated_generate: tuple[Path, torch.Tensor]) -> None:
    cfg_path, _ = fabricated_generate
    r = _eagle3_in_process("stage", "vocab", "-c", str(cfg_path), env={"EAGLE3_VOCAB__DRAFT_VOCAB_SIZE": str(V + 1)})
    assert r.exit_code == 1
    assert r.output.startswith(f"error: vocab.draft_vocab_size={V + 1} exceeds the target vocab size {V} (from file://")
    assert r.output.count("\n") == 1


def test_missing_upstream_is_one_line_error(tmp_path: Path) -> None:
    r = _eagle3_in_process("stage", "vocab", "--store", f"file://{tmp_path}", "--run-id", "r9")
    assert r.exit_code == 1
    assert r.output.strip() == f"error: stage vocab needs generate, which is not complete: no manifest at file://{tmp_path}/r9/generate/manifest.json"


def test_deep_check_catches_a_tampered_mapping(fabricated_generate: tuple[Path, torch.Tensor]) -> None:
    cfg_path, counts = fabricated_generate
    cfg = load_config(cfg_path)
    from eagle3.context import run_stage

    run_stage(cfg, "vocab")
    store = open_store(cfg.store.uri)
    good = read_manifest(store, "r1", "vocab")
    assert good is not None and deep_check(store, good.manifest) == []
    # Re-commit a well-formed mapping that is NOT the top-N of token_freq: sha256 and
    # sizes are consistent, so only the content check can tell.
    d2t, t2d = build_vocab_mapping(counts, N)
    swap_out = int(draft_to_target(d2t)[0])
    swap_in = int(torch.nonzero(~t2d)[0])
    t2d_bad = t2d.clone()
    t2d_bad[swap_out], t2d_bad[swap_in] = False, True
    ids = t2d_bad.nonzero().flatten()
    d2t_bad = ids - torch.arange(N)
    coverage_json = store.get_bytes(key_of(store, 'r1', "vocab", 'coverage.json'))
    coverage_png = store.get_bytes(key_of(store, 'r1', "vocab", 'coverage.png'))
    out = StageOutput(store, "r1", "vocab", good.manifest.input_key, good.manifest.upstream)
    out.begin()
    out.put_bytes("vocab_mapping.safetensors", save_bytes({"d2t": d2t_bad, "t2d": t2d_bad}))
    out.put_bytes("coverage.json", coverage_json)
    out.put_bytes("coverage.png", coverage_png)
    out.commit(good.manifest.stats)
    v = verify_stage(store, "r1", "vocab", deep=True, content_check=deep_check)
    assert not v.complete
    assert v.problems == [f"{store.uri}/{key_of(store, 'r1', 'vocab', 'vocab_mapping.safetensors')} is not the top-{N} "
                          f"mapping of generate/token_freq.safetensors"]
    # A mapping that is not even self-consistent: t2d disagrees with d2t.
    out = StageOutput(store, "r1", "vocab", good.manifest.input_key, good.manifest.upstream)
    out.begin()
    out.put_bytes("vocab_mapping.safetensors", save_bytes({"d2t": d2t, "t2d": t2d_bad}))
    out.put_bytes("coverage.json", coverage_json)
    out.put_bytes("coverage.png", coverage_png)
    out.commit(good.manifest.stats)
    r = _eagle3ctl("verify", "-c", str(cfg_path), "--stage", "vocab", "--deep")
    assert r.exit_code == 1
    assert "d2t maps draft ids to target ids that t2d does not mark" in r.stdout


@pytest.mark.s3
@pytest.mark.slow
def test_stage_runs_on_s3(s3_store_uri: str, tmp_path: Path) -> None:
    cfg = load_config(None, {"run_id": "r3", "store.uri": s3_store_uri, "vocab.draft_vocab_size": 50})
    store = open_store(cfg.store.uri)
    commit_fabricated_generate(store, cfg, vocab_size=300)
    r = _eagle3_in_process("stage", "vocab", "--store", s3_store_uri, "--run-id", "r3", env={"EAGLE3_VOCAB__DRAFT_VOCAB_SIZE": "50"})
    assert r.exit_code == 0, r.output
    v = verify_stage(store, "r3", "vocab", deep=True, content_check=deep_check)
    assert v.complete, v.problems
