"""Helpers that set up real upstream stages for extract/export/evaluate tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle3.config import PipelineConfig, load_config
from eagle3.generate.tokenized import TOKENIZED, from_lists, write_tokenized
from eagle3.manifest import StageOutput
from eagle3.store import open_store
from tests.committed import key_of, put_required


def pipeline_config(store_dir: Path, target_dir: Path, **overrides: Any) -> PipelineConfig:
    """Config of a run ``t`` on a file:// store, its target a tiny target directory."""
    base = {"store.uri": f"file://{store_dir}", "run_id": "t", "target.model": str(target_dir)}
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
    put_required(out, "generate")
    out.commit({"samples": len(samples)})


def commit_vocab(cfg: PipelineConfig, counts: torch.Tensor, draft_vocab_size: int, tmp: Path) -> None:
    """A committed vocab stage built with the real mapping functions from ``counts``."""
    from eagle3.vocab.mapping import build_vocab_mapping, save_vocab_mapping

    store = open_store(cfg.store.uri)
    out = StageOutput(store, cfg.run_id, "vocab", "test-vocab", {})
    out.begin()
    d2t, t2d = build_vocab_mapping(counts, draft_vocab_size)
    save_vocab_mapping(tmp / "vocab_mapping.safetensors", d2t, t2d)
    out.put_file("vocab_mapping.safetensors", tmp / "vocab_mapping.safetensors")
    put_required(out, "vocab")
    out.commit({"draft_vocab_size": draft_vocab_size})


def commit_untrained_train(cfg: PipelineConfig, draft_vocab_size: int, tmp: Path, seed: int = 0) -> Any:
    """A committed train stage holding a randomly initialised drafter (stand-in for training)."""
    from eagle3.drafter.adapter import save_drafter
    from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3.extract.shards import INDEX
    from eagle3.targets.load import load_target_config

    store = open_store(cfg.store.uri)
    import json

    index = json.loads(store.get_bytes(key_of(store, cfg.run_id, "extract", f"{INDEX}")))
    dcfg = DrafterConfig.from_target(load_target_config(cfg.target), cfg.drafter, draft_vocab_size, index["aux_layer_ids"])
    torch.manual_seed(seed)
    model = Eagle3Drafter(dcfg)
    weights, config = save_drafter(model, tmp / "train")
    out = StageOutput(store, cfg.run_id, "train", "test-train", {})
    out.begin()
    out.put_file(weights.name, weights)
    out.put_file(config.name, config)
    put_required(out, "train")
    out.commit({"steps": 0})
    return model
