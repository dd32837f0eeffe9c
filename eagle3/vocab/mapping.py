"""Draft vocab mapping as pure functions: tensors in, tensors out.

The draft vocab is the top-N target tokens by frequency over loss-masked (assistant)
tokens. Draft ids are ordered by ascending target id (as SpecForge and speculators do),
and the mapping is stored the way vLLM's ``llama_eagle3.py`` reads it:

- ``d2t`` int64 [N]: an offset, ``target_id = draft_id + d2t[draft_id]``
- ``t2d`` bool  [V]: ``t2d[target_id]`` is True when the token is in the draft vocab
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3.errors import StageError

D2T = "d2t"
T2D = "t2d"


def _check_counts(counts: torch.Tensor) -> None:
    if counts.dim() != 1 or counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise StageError(f"token counts must be a 1-D integer tensor, got {counts.dtype} {tuple(counts.shape)}")
    if counts.numel() and int(counts.min()) < 0:
        raise StageError("token counts must be non-negative")


def top_token_ids(counts: torch.Tensor, n: int) -> torch.Tensor:
    """Target ids of the n most frequent tokens, ties broken by lower id. LongTensor [n]."""
    # A stable descending sort keeps equal counts in id order, so ties (and the zero-count
    # ids that fill a vocab larger than what was seen) go to the lowest ids.
    order = torch.sort(counts.to(torch.int64), descending=True, stable=True).indices  # [V]
    return order[:n]


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts int [V] → (d2t int64 [N], t2d bool [V]) for the top-N tokens.

    Always exactly N draft tokens: if fewer than N distinct tokens were seen, the most
    frequent unseen ids by id order fill the rest (vLLM expects the configured size).
    """
    _check_counts(counts)
    vocab_size = counts.numel()
    n = int(draft_vocab_size)
    if n < 1:
        raise StageError(f"draft vocab size must be at least 1, got {n}")
    if n > vocab_size:
        raise StageError(f"draft vocab size {n} exceeds the target vocab size {vocab_size}")
    target_ids = top_token_ids(counts, n).sort().values  # [N] ascending target ids
    d2t = target_ids - torch.arange(n, dtype=torch.int64)  # [N]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
    t2d[target_ids] = True
    return d2t, t2d


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft ids 0..N-1. LongTensor [N]."""
    return d2t.to(torch.int64) + torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device)


def target_to_draft_index(t2d: torch.Tensor) -> torch.Tensor:
    """Draft id of every target id, -1 where the token is not in the draft vocab. LongTensor [V]."""
    # Draft ids follow ascending target ids, so a token's draft id is the count of
    # draft tokens before it.
    index = torch.cumsum(t2d.to(torch.int64), 0) - 1  # [V]
    return torch.where(t2d, index, torch.full_like(index, -1))


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of counted (loss-masked) tokens whose id is in the draft vocab; 0.0 if none counted."""
    total = int(counts.sum())
    return float(int(counts[t2d].sum()) / total) if total else 0.0


def coverage_curve(counts: torch.Tensor, sizes: list[int]) -> list[tuple[int, float]]:
    """(N, coverage of the top-N tokens) for each N in sizes (clipped to the vocab)."""
    cumulative = cumulative_coverage(counts)  # [V]
    out = []
    for n in sorted({min(max(int(s), 1), counts.numel()) for s in sizes}):
        out.append((n, float(cumulative[n - 1])))
    return out


def cumulative_coverage(counts: torch.Tensor) -> torch.Tensor:
    """Coverage of the top-k tokens for k = 1..V. DoubleTensor [V]."""
    ranked = torch.sort(counts.to(torch.int64), descending=True).values  # [V]
    total = max(int(ranked.sum()), 1)
    return torch.cumsum(ranked, 0).to(torch.float64) / total


def validate_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int | None = None) -> list[str]:
    """Problems with a mapping (empty when it is well-formed)."""
    problems = []
    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        problems.append(f"d2t must be int64 [N], got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        problems.append(f"t2d must be bool [V], got {t2d.dtype} {tuple(t2d.shape)}")
    if problems:
        return problems
    n, v = d2t.numel(), t2d.numel()
    if vocab_size is not None and v != vocab_size:
        problems.append(f"t2d covers {v} target tokens, the target vocab has {vocab_size}")
    if int(t2d.sum()) != n:
        problems.append(f"t2d marks {int(t2d.sum())} tokens, d2t has {n} draft tokens")
    target_ids = draft_to_target(d2t)  # [N]
    if n and (int(target_ids.min()) < 0 or int(target_ids.max()) >= v):
        problems.append(f"d2t maps draft ids to target ids outside [0, {v})")
        return problems
    if n > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
        problems.append("d2t target ids are not strictly ascending (duplicate or unordered draft tokens)")
    if n and not bool(t2d[target_ids].all()):
        problems.append("d2t maps draft ids to target ids that t2d does not mark")
    return problems


def save_vocab_mapping(path: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    save_file({D2T: d2t.contiguous(), T2D: t2d.contiguous()}, str(path))


def load_vocab_mapping(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [N], t2d bool [V]) from a vocab_mapping.safetensors; a malformed file is a StageError."""
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise StageError(f"vocab mapping {path} is not a readable safetensors file: {e}") from None
    missing = [k for k in (D2T, T2D) if k not in tensors]
    if missing:
        raise StageError(f"vocab mapping {path} lacks tensor(s) {', '.join(missing)}")
    d2t, t2d = tensors[D2T], tensors[T2D]
    problems = validate_vocab_mapping(d2t, t2d)
    if problems:
        raise StageError(f"vocab mapping {path}: {problems[0]}")
    return d2t, t2d
