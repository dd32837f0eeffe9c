"""Fabricated upstream data: a well-formed committed ``generate`` stage without a server.

``commit_fabricated_generate`` writes what the real generate stage writes (tokenized
samples with loss masks, token_freq counted over the masked tokens, metadata.json),
through :class:`StageOutput` with the input key the stage entrypoint computes, so
downstream stages (vocab, extract) run on it exactly as on real output. The data is
fake: token ids are drawn from a Zipf-like distribution, not produced by a model.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3.config import PipelineConfig
from eagle3.contract import stage_input_key
from eagle3.generate.samples import token_frequencies
from eagle3.generate.tokenized import TokenizedSamples, write_tokenized
from eagle3.manifest import LoadedManifest, StageOutput
from eagle3.stages import get_stage
from eagle3.store import ObjectStore


def fabricate_samples(vocab_size: int, num_samples: int = 40, seed: int = 0) -> TokenizedSamples:
    """Samples of 20–80 tokens: a prompt part (mask 0) then a response part (mask 1)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 81, (num_samples,), generator=g)  # [n]
    total = int(lengths.sum())
    # Zipf-like ids: a few very frequent tokens, a long tail, some never used.
    weights = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)  # [V]
    perm = torch.randperm(vocab_size, generator=g)
    ids = perm[torch.multinomial(weights, total, replacement=True, generator=g)]  # [T]
    offsets = torch.zeros(num_samples + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    mask = torch.zeros(total, dtype=torch.uint8)
    for i in range(num_samples):  # tiny fixture data: a loop over samples is fine here
        a, b = int(offsets[i]), int(offsets[i + 1])
        mask[a + (b - a) // 3 : b] = 1
    return TokenizedSamples(ids.to(torch.int32), mask, offsets, torch.arange(num_samples, dtype=torch.int64))


def commit_fabricated_generate(
    store: ObjectStore,
    cfg: PipelineConfig,
    vocab_size: int = 1000,
    counts: torch.Tensor | None = None,
    seed: int = 0,
) -> LoadedManifest:
    """Commit a generate stage for ``cfg.run_id``; ``counts`` overrides the derived token_freq."""
    spec = get_stage("generate")
    out = StageOutput(store, cfg.run_id, "generate", stage_input_key(cfg, spec, {}), {})
    out.begin()
    samples = fabricate_samples(vocab_size, seed=seed)
    counts = token_frequencies(samples, vocab_size) if counts is None else counts  # generate's own count
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenized(Path(tmp) / "tokenized.safetensors", samples)
        out.put_file("tokenized.safetensors", Path(tmp) / "tokenized.safetensors")
        save_file({"counts": counts}, str(Path(tmp) / "token_freq.safetensors"))
        out.put_file("token_freq.safetensors", Path(tmp) / "token_freq.safetensors")
    out.put_bytes("raw_responses.jsonl", b"".join(b'{"id": %d, "fabricated": true}\n' % i for i in range(len(samples))))
    meta = {"samples": len(samples), "tokens": samples.num_tokens, "target_vocab_size": vocab_size, "fabricated": True}
    out.put_json("metadata.json", meta)
    return out.commit(meta)
