"""Partial writes a killed writer left: ``verify`` names them, and the next run removes those idle
for a whole lease TTL once it holds the run (one left by a writer that may still live stays)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from eagle3.cli.backends import open_backend
from eagle3.pipeline.runner import run_pipeline
from eagle3.pipeline.scheduler import Selection
from eagle3.verify import verify_run
from tests.pipeline.test_scheduler import run as run_with_doubles
from tests.pipeline.test_scheduler import setup as config_and_store


def _partial(folder: Path, name: str, age_s: float) -> Path:
    """A hidden partial file as the local store's writer names it, last written ``age_s`` ago."""
    path = folder / f".{name}.1a2b3c4d.partial"
    path.write_bytes(b'{"half": ')
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_stale_partial_write_is_named_by_verify_and_removed_when_the_run_next_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, store = config_and_store(tmp_path)
    run_with_doubles(cfg, store, tmp_path)  # every stage committed
    vocab = tmp_path / "store" / cfg.run_id / "vocab"
    stale = _partial(vocab, "manifest.json", 3 * cfg.lease_ttl_s)  # a commit killed mid-write, hours ago
    fresh = _partial(vocab, "coverage.json", 0)  # maybe a live writer's
    lines: list[str] = []
    assert verify_run(cfg, None, False, lines.append)  # every stage is still complete
    at = lines.index("partial writes: 2 begun and never finished (the next `eagle3ctl run` removes those idle over "
                     "lease_ttl_s)")
    assert lines[at + 1:] == [f"  {store.uri}/t1/vocab/coverage.json: last written 0s ago",
                              f"  {store.uri}/t1/vocab/manifest.json: last written 3 min ago"]
    lines.clear()
    assert verify_run(cfg, ["train"], False, lines.append) and not any("partial" in ln for ln in lines)

    monkeypatch.chdir(tmp_path)
    said: list[str] = []
    result = run_pipeline(cfg, Selection(), said.append, open_backend, tty=False).result
    assert result.ok
    assert not stale.exists() and fresh.exists()
    assert (f"removed 1 partial write an earlier attempt left in {store.uri}/t1 (idle over lease_ttl_s, "
            f"{cfg.lease_ttl_s:.0f}s)") in said
