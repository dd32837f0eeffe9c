"""Helpers that set up real upstream stages for extract/export/evaluate tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle3.config import PipelineConfig, load_config
from eagle3.data.tokenized import TOKENIZED, from_lists, write_tokenized
from eagle3.manifest import StageOutput
from eagle3.store import open_store


def pipeline_config(store_dir: Path, cache_dir: Path, arch: str = "llama", **overrides: Any) -> PipelineConfig:
    base = {
        "store.uri": f"file://{store_dir}",
        "run_id": "t",
        "target.model": f"builtin:tiny-{arch}",
        "target.cache_dir": str(cache_dir),
    }
    return load_config(None, {**base, **overrides})


def random_samples(n: int, seed: int = 0, vocab: int = 900, lo: int = 5, hi: int = 40) -> list[tuple[int, list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        prompt = max(1, length // 3)
        out.append((100 + i, ids, [0] * prompt + [1] * (length - prompt)))
    return out


def commit_generate(cfg: PipelineConfig, samples: list[tuple[int, list[int], list[int]]], tmp: Path,
                    extra: dict[str, bytes] | None = None) -> None:
    """A committed generate stage holding ``samples`` (test stand-in for running generate)."""
    store = open_store(cfg.store.uri)
    out = StageOutput(store, cfg.run_id, "generate", "test-generate", {})
    out.begin()
    path = tmp / TOKENIZED
    write_tokenized(path, from_lists(samples))
    out.put_file(TOKENIZED, path)
    for name, data in (extra or {}).items():
        out.put_bytes(name, data)
    out.commit({"samples": len(samples)})
