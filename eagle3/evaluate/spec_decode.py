"""Offline greedy speculative decoding: an HF target verifies a chain of EAGLE-3 drafts.

One prompt at a time. The invariant at the start of each round, with ``seq`` the
verified tokens (prompt + generated, length n):

- the target's KV cache holds positions 0..n-2 (every verified token but the last);
- the drafter's KV cache holds rows 0..m-1; rows m..n-2 are pending, with the target's
  aux hidden states of those positions kept in ``pending_aux``.

A round: the drafter consumes the pending rows (row t: fc(aux_t), token seq[t+1],
position t — the alignment it was trained on) and proposes d_1 from the last row, then
d_2..d_k from its own hidden output; the target verifies [seq[n-1], d_1..d_k] in one
forward; the longest prefix of drafts equal to the target's greedy choices is accepted,
plus the target's own next token (the bonus). Both caches are cropped back to verified
positions, so the output is exactly the target's greedy output.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from eagle3.drafter.caches import KVCache
from eagle3.drafter.model import Eagle3Drafter
from eagle3.targets.capture import HiddenCapture


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens, cut at max_new_tokens and after the first EOS
    accept_lengths: list[int] = field(default_factory=list)  # per verify step: accepted drafts + 1
    accepted_at: list[int] = field(default_factory=list)  # [k]: steps whose draft i was accepted

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)


def _cache_kwarg(model: Any) -> str:
    """transformers 5 calls the KV cache argument ``cache``; 4.x called it ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def new_cache() -> Any:
    """The target's KV cache: a plain DynamicCache, every layer keeps every position, so rejected drafts can be
    cropped away. (``DynamicCache(config=...)`` gives sliding-window layers that refuse to
    crop once the window is full; the model's own masks apply the window either way.)"""
    from transformers import DynamicCache

    return DynamicCache()


def _crop_target(cache: Any, keep: int) -> None:
    # A negative argument removes that many positions in transformers 4.x and 5.x alike.
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def _crop_drafter(cache: KVCache, rows: int) -> None:
    if cache.k is not None and cache.v is not None:
        cache.k, cache.v = cache.k[:, :, :rows], cache.v[:, :, :rows]


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    out = tokens[:max_new_tokens]
    for i, t in enumerate(out):
        if t in eos_ids:
            return out[: i + 1]
    return out


def _done(generated: list[int], max_new_tokens: int, eos_ids: set[int]) -> bool:
    return len(generated) >= max_new_tokens or any(t in eos_ids for t in generated)


class SpeculativeDecoder:
    def __init__(self, target: Any, capture: HiddenCapture, drafter: Eagle3Drafter, d2t: Tensor,
                 num_draft_tokens: int, eos_ids: set[int]) -> None:
        self.target, self.capture, self.drafter = target, capture, drafter
        self.k, self.eos_ids = num_draft_tokens, eos_ids
        self.device = next(drafter.parameters()).device
        self.draft_to_target = torch.arange(d2t.numel(), device=self.device) + d2t.to(self.device)  # [N]
        self.input_device = target.get_input_embeddings().weight.device
        self._cache_kw = _cache_kwarg(target)

    def _target(self, ids: list[int], cache: Any) -> tuple[Tensor, Tensor]:
        """Forward ``ids`` after the cached positions → (greedy next tokens [T], aux [T, 3Ht])."""
        x = torch.tensor([ids], device=self.input_device)
        out = self.target(input_ids=x, use_cache=True, **{self._cache_kw: cache})
        aux, _ = self.capture.pop()
        aux_cat = torch.cat([a[0].to(self.device) for a in aux], dim=-1)  # [T, 3Ht]
        return out.logits[0].argmax(-1).tolist(), aux_cat

    def _draft_rows(self, seq: list[int], aux: Tensor, start: int, cache: KVCache) -> tuple[Tensor, int]:
        """Drafter rows start..start+len(aux)-1 → (last row's hidden out [1, 1, H], proposed target id)."""
        n = aux.shape[0]
        tokens = torch.tensor([seq[start + 1 : start + 1 + n]], device=self.device)  # [1, n]
        positions = torch.arange(start, start + n, device=self.device)[None]  # [1, n]
        hidden = self.drafter.project_aux(aux[None].to(self.drafter.fc.weight.dtype))  # [1, n, H]
        out, logits, _ = self.drafter.step(tokens, hidden, positions, cache)
        return out[:, -1:], int(self.draft_to_target[logits[0, -1].argmax()])

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int) -> DecodeResult:
        result = DecodeResult(tokens=[], accepted_at=[0] * self.k)
        target_cache, draft_cache = new_cache(), KVCache()
        greedy, pending_aux = self._target(prompt, target_cache)
        seq = list(prompt) + [greedy[-1]]
        drafted_rows = 0  # m: rows the drafter's cache holds
        while not _done(seq[len(prompt):], max_new_tokens, self.eos_ids):
            n = len(seq)
            hidden, proposal = self._draft_rows(seq, pending_aux, drafted_rows, draft_cache)
            drafted_rows = n - 1
            drafts = [proposal]
            for j in range(1, self.k):  # chain: the drafter's own output, one position further each time
                position = torch.tensor([[n - 2 + j]], device=self.device)
                token = torch.tensor([[drafts[-1]]], device=self.device)
                hidden, logits, _ = self.drafter.step(token, hidden, position, draft_cache)
                drafts.append(int(self.draft_to_target[logits[0, -1].argmax()]))
            _crop_drafter(draft_cache, drafted_rows)
            greedy, aux = self._target([seq[-1], *drafts], target_cache)  # greedy[i] follows draft i
            accepted = 0
            while accepted < self.k and drafts[accepted] == greedy[accepted]:
                result.accepted_at[accepted] += 1
                accepted += 1
            seq += drafts[:accepted] + [greedy[accepted]]
            result.accept_lengths.append(accepted + 1)
            _crop_target(target_cache, n + accepted)  # keep seq[n-1] and the accepted drafts
            pending_aux = aux[: accepted + 1]
        result.tokens = _finish(seq[len(prompt):], max_new_tokens, self.eos_ids)
        return result


@torch.inference_mode()
def greedy_generate(target: Any, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """Plain greedy decoding with the target, one token per forward (the reference output)."""
    kw = _cache_kwarg(target)
    cache = new_cache()
    device = target.get_input_embeddings().weight.device
    ids, generated = list(prompt), []
    while not _done(generated, max_new_tokens, eos_ids):
        out = target(input_ids=torch.tensor([ids], device=device), use_cache=True, **{kw: cache})
        generated.append(int(out.logits[0, -1].argmax()))
        ids = generated[-1:]
    return _finish(generated, max_new_tokens, eos_ids)
