"""Batched offline speculative decoding: B prompts in lockstep, exactly as one at a time.

Per round, the whole batch takes k drafter steps and ONE target forward, where
:class:`~eagle3.evaluate.spec_decode.SpeculativeDecoder` takes them per prompt. The output
of every prompt is the one ``SpeculativeDecoder.generate`` gives on it alone (tokens,
accept lengths, accepted positions); only the float summation order differs.

Nothing is cropped per row, since the caches must stay rectangular. Each cache column is a
*slot*; every row keeps per slot ``valid`` and ``position`` (:class:`Slots`). A new query
sees that row's valid slots at positions <= its own (and itself, so padding queries stay
finite); the target gets this as an explicit 4D mask with explicit ``position_ids``, the
drafter through :class:`MaskedKVCache` (its ``attend``). RoPE takes the positions given,
so padding slots shift nothing. Invariants per row, as in the sequential decoder:

- target cache: valid slots hold positions 0..n-2 of ``seq``; each round appends k+1
  slots per row ([seq[n-1], d_1..d_k]); the rejected drafts' slots become invalid.
- drafter cache: valid slots hold rows 0..m-1; each round's first step appends the
  pending rows (prefill: the prompt; later accepted+1 rows), padded to the batch's most
  with invalid slots; the k-1 chain slots are the last columns of every row and are cut.

Rows that finish leave the batch (caches and state are index-selected), and trailing
columns invalid in every row are cut. Targets whose attention cannot take a custom 4D
mask (flash attention, sliding windows, mixed layer types) are decoded one prompt at a time,
with the reason in :attr:`BatchedSpeculativeDecoder.fallback_reason`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.drafter.model import Eagle3Drafter
from eagle3.evaluate.spec_decode import DecodeResult, SpeculativeDecoder, _done, _finish, new_cache
from eagle3.targets.capture import HiddenCapture

MASKABLE_ATTENTION = ("eager", "sdpa")  # implementations that add a given 4D mask as it is


def batching_unsupported(target: Any) -> str | None:
    """Why ``target`` cannot be decoded batched with a custom 4D mask, or None when it can."""
    config = target.config
    attn = getattr(config, "_attn_implementation", None)
    if attn not in MASKABLE_ATTENTION:
        return f"attention implementation {attn!r} does not take a custom 4D mask (needs one of {MASKABLE_ATTENTION})"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        return f"layer types {sorted(layer_types)}: only full-attention layers keep every slot"
    if getattr(config, "sliding_window", None):
        return f"sliding window {config.sliding_window}: the 4D mask would replace the window"
    params = inspect.signature(target.forward).parameters
    missing = [p for p in ("attention_mask", "position_ids") if p not in params]
    if missing:
        return f"{type(target).__name__}.forward takes no {', '.join(missing)}"
    return None


class Slots:
    """Per-row slots of a rectangular batch cache: ``valid`` [B, S] bool, ``pos`` [B, S] long."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.pos = torch.zeros(batch, 0, dtype=torch.long, device=device)

    @property
    def length(self) -> int:
        return int(self.valid.shape[1])

    def append(self, valid: Tensor, pos: Tensor) -> Tensor:
        """Add T slots per row (valid, pos [B, T]) → bool mask [B, 1, T, S+T] of the new queries:
        the row's valid slots at positions <= the query's, and the query's own slot."""
        self.valid, self.pos = torch.cat([self.valid, valid], 1), torch.cat([self.pos, pos], 1)
        s, t = self.length, valid.shape[1]
        allowed = self.valid[:, None, :] & (self.pos[:, None, :] <= pos[:, :, None])  # [B, T, S]
        cols = torch.arange(s, device=pos.device)
        own = cols[None, :] == (cols[s - t:])[:, None]  # [T, S]
        return (allowed | own)[:, None]

    def trailing_invalid(self) -> int:
        """Columns at the end that are invalid in every row."""
        used = self.valid.any(0).nonzero()
        return self.length - (int(used[-1]) + 1 if used.numel() else 0)

    def crop(self, length: int) -> None:
        self.valid, self.pos = self.valid[:, :length], self.pos[:, :length]

    def select(self, rows: Tensor) -> None:
        self.valid, self.pos = self.valid[rows], self.pos[rows]


class MaskedKVCache:
    """The drafter's KV cache of a batch: call :meth:`add` with the new slots before each step."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.k: Tensor | None = None  # [B, kv, S, D]
        self.v: Tensor | None = None
        self.slots = Slots(batch, device)
        self._mask: Tensor | None = None  # [B, 1, T, S+T] of the next attend

    @property
    def length(self) -> int:
        return self.slots.length

    def add(self, valid: Tensor, pos: Tensor) -> None:
        self._mask = self.slots.append(valid, pos)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, h, T, D], k/v [B, kv, T, D] → [B, h, T, D]."""
        mask, self._mask = self._mask, None
        if mask is None or mask.shape[-1] != (0 if self.k is None else self.k.shape[2]) + k.shape[2]:
            raise RuntimeError("MaskedKVCache.attend without add() of exactly these slots")
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        keys, values = self.k, self.v
        if q.is_cuda and q.shape[1] != keys.shape[1]:  # expanded kv heads keep a masked call off the math kernel
            rep = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    def crop(self, length: int) -> None:
        if self.k is not None and self.v is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]
        self.slots.crop(length)

    def select(self, rows: Tensor) -> None:
        if self.k is not None and self.v is not None:
            self.k, self.v = self.k[rows], self.v[rows]
        self.slots.select(rows)


@dataclass
class _Row:
    index: int  # into the prompts
    prompt_len: int
    seq: list[int]  # verified tokens: prompt + generated
    result: DecodeResult


class BatchedSpeculativeDecoder:
    """:class:`SpeculativeDecoder` for a batch of prompts; same constructor arguments."""

    def __init__(self, target: Any, capture: HiddenCapture, drafter: Eagle3Drafter, d2t: Tensor,
                 num_draft_tokens: int, eos_ids: set[int]) -> None:
        self.sequential = SpeculativeDecoder(target, capture, drafter, d2t, num_draft_tokens, eos_ids)
        s = self.sequential
        self.target, self.capture, self.drafter, self.k, self.eos_ids = target, capture, drafter, s.k, eos_ids
        self.device, self.input_device, self.draft_to_target = s.device, s.input_device, s.draft_to_target
        self._cache_kw = s._cache_kw
        self.dtype = target.get_input_embeddings().weight.dtype
        self.fallback_reason = batching_unsupported(target)

    def _target(self, ids: Tensor, pos: Tensor, valid: Tensor, slots: Slots, cache: Any) -> tuple[Tensor, Tensor]:
        """ids/pos/valid [B, T] after the cached slots → (greedy next tokens [B, T], aux [B, T, 3Ht])."""
        allowed = slots.append(valid, pos).to(self.input_device)  # [B, 1, T, S+T]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.input_device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        out = self.target(input_ids=ids.to(self.input_device), position_ids=pos.to(self.input_device),
                          attention_mask=mask, use_cache=True, **{self._cache_kw: cache})
        aux, _ = self.capture.pop()
        aux_cat = torch.cat([a.to(self.device) for a in aux], dim=-1)  # [B, T, 3Ht]
        return out.logits.argmax(-1).to(self.device), aux_cat

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[DecodeResult]:
        if self.fallback_reason is not None or len(prompts) <= 1:
            return [self.sequential.generate(p, max_new_tokens) for p in prompts]
        dev, k = self.device, self.k
        b = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=dev)  # [B]
        width = int(lens.max())
        ids = torch.zeros(b, width, dtype=torch.long, device=dev)  # right-padded with invalid slots
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, device=dev)
        pos = torch.arange(width, device=dev)[None].expand(b, width)  # [B, W]
        valid = pos < lens[:, None]
        target_cache, target_slots = new_cache(), Slots(b, dev)
        greedy, aux = self._target(ids, pos, valid, target_slots, target_cache)
        bonus = greedy[torch.arange(b, device=dev), lens - 1]  # [B]
        rows = [_Row(i, len(p), list(p) + [int(t)], DecodeResult(tokens=[], accepted_at=[0] * k))
                for i, (p, t) in enumerate(zip(prompts, bonus.tolist()))]
        # Pending drafter rows: row t takes fc(aux_t), token seq[t+1], position t.
        tokens = torch.cat([ids[:, 1:], ids[:, :1]], 1)
        tokens[torch.arange(b, device=dev), lens - 1] = bonus
        draft_cache = MaskedKVCache(b, dev)
        results: list[DecodeResult | None] = [None] * b
        while True:
            done = [_done(r.seq[r.prompt_len:], max_new_tokens, self.eos_ids) for r in rows]
            for r, d in zip(rows, done):
                if d:
                    r.result.tokens = _finish(r.seq[r.prompt_len:], max_new_tokens, self.eos_ids)
                    results[r.index] = r.result
            if all(done):
                break
            if any(done):
                keep = torch.tensor([i for i, d in enumerate(done) if not d], device=dev)
                rows = [r for r, d in zip(rows, done) if not d]
                target_cache.batch_select_indices(keep.to(self.input_device))
                target_slots.select(keep)
                draft_cache.select(keep)
                tokens, aux, pos, valid = tokens[keep], aux[keep], pos[keep], valid[keep]
            tokens, aux, pos, valid = self._round(rows, tokens, aux, pos, valid, target_cache, target_slots,
                                                  draft_cache)
            cut = target_slots.trailing_invalid()  # columns no row uses any more
            if cut:
                target_cache.crop(-cut)
                target_slots.crop(target_slots.length - cut)
            cut = draft_cache.slots.trailing_invalid()
            if cut:
                draft_cache.crop(draft_cache.length - cut)
        return results  # type: ignore[return-value]

    def _round(self, rows: list[_Row], tokens: Tensor, aux: Tensor, pos: Tensor, valid: Tensor, target_cache: Any,
               target_slots: Slots, draft_cache: MaskedKVCache) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One draft chain + verification for every row; → the next round's pending drafter rows
        (tokens, aux, pos, valid [B, C'])."""
        dev, k, b = self.device, self.k, len(rows)
        batch = torch.arange(b, device=dev)
        n = torch.tensor([len(r.seq) for r in rows], device=dev)  # [B]
        last = valid.long().sum(1) - 1  # [B] each row's last pending row (valid ones come first)
        draft_cache.add(valid, pos)
        hidden = self.drafter.project_aux(aux.to(self.drafter.fc.weight.dtype))  # [B, C, H]
        out, logits, _ = self.drafter.step(tokens, hidden, pos, draft_cache)
        hidden = out[batch, last][:, None]  # [B, 1, H]
        drafts = [self.draft_to_target[logits[batch, last].argmax(-1)]]  # k x [B]
        verified_slots = draft_cache.length
        every = torch.ones(b, 1, dtype=torch.bool, device=dev)
        for j in range(1, k):  # chain: the drafter's own output, one position further each time
            position = (n - 2 + j)[:, None]  # [B, 1]
            draft_cache.add(every, position)
            hidden, logits, _ = self.drafter.step(drafts[-1][:, None], hidden, position, draft_cache)
            drafts.append(self.draft_to_target[logits[:, -1].argmax(-1)])
        draft_cache.crop(verified_slots)
        chain = torch.stack(drafts, 1)  # [B, k]
        last_tok = torch.tensor([r.seq[-1] for r in rows], device=dev)
        ids = torch.cat([last_tok[:, None], chain], 1)  # [B, k+1]
        vpos = (n - 1)[:, None] + torch.arange(k + 1, device=dev)  # [B, k+1]
        greedy, vaux = self._target(ids, vpos, torch.ones_like(ids, dtype=torch.bool), target_slots, target_cache)
        accepted = (chain == greedy[:, :k]).long().cumprod(1).sum(1)  # [B]
        steps = torch.arange(k + 1, device=dev)[None]
        target_slots.valid[:, -(k + 1):] &= steps <= accepted[:, None]  # keep seq[n-1] and the accepted drafts
        for r, a, g, d in zip(rows, accepted.tolist(), greedy.tolist(), chain.tolist()):
            for i in range(a):
                r.result.accepted_at[i] += 1
            r.seq += d[:a] + [g[a]]
            r.result.accept_lengths.append(a + 1)
        width = int(accepted.max()) + 1  # next pending rows n-1..n-1+accepted: tokens greedy[0..accepted]
        return greedy[:, :width], vaux[:, :width], vpos[:, :width], (steps[:, :width] <= accepted[:, None])
