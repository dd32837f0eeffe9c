"""Benchmark: draft vocab mapping at Kimi scale, against a hand-written-script baseline.

Synthetic data standing in for a real run: 30M loss-masked token ids over Kimi-K2.5's
vocab (163,840) drawn from a Zipf law (token frequencies in text follow one), N=32,000.

Timed:
- token_freq: torch.bincount over the loss-masked ids (what generate does),
  vs collections.Counter over the ids (the baseline a script would write);
- mapping: eagle3.vocab.mapping.build_vocab_mapping + coverage,
  vs a naive reference (a dict of counts sorted in Python, lists for d2t/t2d).

Both sides must produce the same mapping; the script checks it.

    python benchmarks/bench_vocab.py [--tokens 30000000] [--out benchmarks/results/vocab.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from eagle3.vocab.mapping import build_vocab_mapping, coverage

KIMI_VOCAB = 163_840


def synthetic_tokens(n_tokens: int, vocab_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids int32 [T], loss_mask uint8 [T]): Zipf(1.1) ids over a shuffled vocab, ~60% masked."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab_size + 1, dtype=torch.float64)
    probs = ranks.pow(-1.1)
    probs /= probs.sum()
    # Inverse-CDF sampling: multinomial over 163K categories for 30M draws is slow.
    cdf = torch.cumsum(probs, 0)  # [V]
    u = torch.rand(n_tokens, generator=g, dtype=torch.float64)  # [T]
    rank_ids = torch.searchsorted(cdf, u).clamp_(max=vocab_size - 1)  # [T]
    perm = torch.randperm(vocab_size, generator=g)
    input_ids = perm[rank_ids].to(torch.int32)  # [T]
    loss_mask = (torch.rand(n_tokens, generator=g) < 0.6).to(torch.uint8)  # [T]
    return input_ids, loss_mask


def token_freq(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """counts int64 [V] over loss-masked tokens (the generate stage's computation)."""
    return torch.bincount(input_ids[loss_mask.bool()].to(torch.int64), minlength=vocab_size)


def naive_token_freq(input_ids: list[int], loss_mask: list[int]) -> Counter[int]:
    return Counter(t for t, m in zip(input_ids, loss_mask) if m)


def naive_mapping(freq: Counter[int] | dict[int, int], vocab_size: int, n: int) -> tuple[list[int], list[bool], float]:
    """What a hand-written script does: sort a dict by count, then build lists."""
    ranked = sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = [tok for tok, _ in ranked[:n]]
    if len(chosen) < n:  # fill with the lowest unseen ids
        seen = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in seen][: n - len(chosen)]
    chosen.sort()
    d2t = [tok - i for i, tok in enumerate(chosen)]
    t2d = [False] * vocab_size
    for tok in chosen:
        t2d[tok] = True
    total = sum(freq.values())
    cov = sum(freq.get(tok, 0) for tok in chosen) / total
    return d2t, t2d, cov


def timed(fn, repeat: int = 3):  # type: ignore[no-untyped-def]
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=30_000_000)
    ap.add_argument("--vocab", type=int, default=KIMI_VOCAB)
    ap.add_argument("--draft-vocab", type=int, default=32_000)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/vocab.json"))
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))  # the target: a 2-core CPU Job

    t0 = time.perf_counter()
    ids, mask = synthetic_tokens(args.tokens, args.vocab)
    print(f"synthetic data: {args.tokens:,} tokens in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    t_freq, counts = timed(lambda: token_freq(ids, mask, args.vocab))
    t_map, (d2t, t2d) = timed(lambda: build_vocab_mapping(counts, args.draft_vocab))
    t_cov, cov = timed(lambda: coverage(counts, t2d))
    print(f"eagle3: token_freq {t_freq:.3f}s, mapping {t_map:.3f}s, coverage {t_cov:.4f}s", file=sys.stderr)

    ids_list, mask_list = ids.tolist(), mask.tolist()
    t_nfreq, freq = timed(lambda: naive_token_freq(ids_list, mask_list), repeat=1)
    del ids_list, mask_list
    t_nmap, (nd2t, nt2d, ncov) = timed(lambda: naive_mapping(freq, args.vocab, args.draft_vocab), repeat=1)
    print(f"naive:  token_freq {t_nfreq:.3f}s, mapping {t_nmap:.3f}s", file=sys.stderr)

    assert dict(freq) == {i: c for i, c in enumerate(counts.tolist()) if c}, "token_freq differs from the baseline"
    assert d2t.tolist() == nd2t and t2d.tolist() == nt2d, "mapping differs from the baseline"
    assert abs(cov - ncov) < 1e-12

    result = {
        "command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
        "machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__},
        "workload": {
            "tokens": args.tokens,
            "loss_masked_tokens": int(counts.sum()),
            "target_vocab_size": args.vocab,
            "draft_vocab_size": args.draft_vocab,
            "distinct_tokens_seen": int((counts > 0).sum()),
            "coverage": round(cov, 6),
        },
        "seconds": {
            "token_freq_bincount": round(t_freq, 4),
            "token_freq_naive_counter": round(t_nfreq, 4),
            "mapping_eagle3": round(t_map, 4),
            "mapping_naive_sorted_dict": round(t_nmap, 4),
            "coverage_eagle3": round(t_cov, 4),
        },
        "speedup": {
            "token_freq": round(t_nfreq / t_freq, 1),
            "mapping": round(t_nmap / t_map, 1),
            "end_to_end": round((t_nfreq + t_nmap) / (t_freq + t_map + t_cov), 1),
        },
        "same_result_as_baseline": True,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
