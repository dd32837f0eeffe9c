"""Deep checks on S3 download objects to look inside them; nothing may be left behind.

A committed run (real extract and export on a tiny target, fabricated generate/vocab/train)
is copied object by object to the moto S3 server; every stage's deep check then runs there
with TMPDIR pointed at an empty folder, which must be empty again afterwards.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from eagle3.config import load_config
from eagle3.context import run_stage
from eagle3.manifest import verify_stage
from eagle3.stages import ORDER, get_stage
from eagle3.store import open_store
from tests.extract.pipeline import commit_generate, commit_untrained_train, commit_vocab, pipeline_config, random_samples

pytestmark = [pytest.mark.s3, pytest.mark.slow]


def test_deep_checks_on_s3_leave_no_temporary_files(tmp_path: Path, tiny_target_dir, s3_store_uri: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    target = tiny_target_dir("llama")
    cfg = pipeline_config(tmp_path / "store", target, **{"extract.shard_tokens": 25, "extract.device": "cpu"})
    commit_generate(cfg, random_samples(8), tmp_path)
    run_stage(cfg, "extract")
    commit_vocab(cfg, torch.arange(1024, 0, -1), 128, tmp_path)
    commit_untrained_train(cfg, 128, tmp_path)
    run_stage(cfg, "export")
    local, s3 = open_store(cfg.store.uri), open_store(s3_store_uri)
    for key in local.list("t"):
        s3.put_file(key, local.local_path(key))
    shards = [k for k in s3.list("t/extract") if "/shards/" in k]
    assert len(shards) >= 3, "several shards, so a per-shard leak would show"

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    s3_cfg = load_config(None, {"store.uri": s3_store_uri, "run_id": "t", "target.model": str(target)})
    checked = []
    for name in ORDER:
        if not s3.has_prefix(f"t/{name}"):
            continue
        # the fabricated stages hold only what their consumers read: their content checks would
        # (rightly) fail; the real stages' checks run, each downloading its objects
        check = get_stage(name).load_check() if name in ("extract", "export") else None
        v = verify_stage(s3, s3_cfg.run_id, name, deep=True, content_check=check)
        assert v.complete, (name, v.problems)
        checked.append(name)
    assert checked == ["generate", "vocab", "extract", "train", "export"]
    assert list(scratch.iterdir()) == [], "a deep check left temporary files behind"
