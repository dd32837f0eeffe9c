"""TTT attention through flex attention: the off-diagonal blocks are empty and skipped.

Packed rows (several samples in one row, a document id per token) add the document
mask to the step-0 block; their block mask is built per batch straight from the
document boundaries (which 128-token blocks a query block can see, and which of those
lie wholly inside its document), without evaluating the mask at every position.

Used on CUDA, where ``torch.compile`` turns flex attention into a fused kernel; the
dense-mask SDPA path in ``model.TTTCache`` is the reference and the CPU path. If the
compiled kernel cannot be built on this machine, the first failure is reported once
and every later call takes the SDPA path (same math, more memory).
"""

from __future__ import annotations

import sys
from functools import lru_cache

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

_compiled = None
_broken: str | None = None


def _flex():
    global _compiled
    if _compiled is None:
        if torch.cuda.is_available():
            # One graph per (sequence length, TTT step) until dynamo goes dynamic: allow many.
            for name in ("cache_size_limit", "recompile_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
            _compiled = torch.compile(flex_attention)
        else:
            _compiled = flex_attention
    return _compiled


@lru_cache(maxsize=256)
def ttt_block_mask(t: int, step: int, device: str) -> BlockMask:
    def mask_mod(b, h, q_idx, kv_idx):
        block, col = kv_idx // t, kv_idx % t
        return ((block == 0) & (col <= q_idx)) | ((block > 0) & (col == q_idx))

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=t, KV_LEN=(step + 1) * t, device=device)


BLOCK = 128


def _lists(visible: Tensor) -> tuple[Tensor, Tensor]:
    """Bool [B, R, C] block visibility → (count [B, 1, R], indices [B, 1, R, C]; the visible ones first, in order)."""
    count = visible.sum(-1, dtype=torch.int32)
    order = torch.argsort((~visible).to(torch.int32), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


class DocBlockMasks:
    """The TTT block masks of one batch of packed rows, doc_ids [B, T] (T a multiple of 128,
    each document contiguous): step k's mask is step 0's — causal within a document — plus
    the diagonal of each of the k later blocks.

    Step 0's block lists (which key blocks each query block sees, partly or wholly, and the
    transposes the backward pass walks) are derived once per batch; each later step appends
    its diagonal blocks to them with a few tensor ops, instead of rebuilding and transposing
    every list per step (about 6× fewer kernel launches per batch)."""

    def __init__(self, doc_ids: Tensor) -> None:
        from eagle3.drafter.model import doc_start_rows

        t = doc_ids.shape[1]
        self.t, self.nb = t, t // BLOCK
        dev = doc_ids.device
        first_kv = doc_start_rows(doc_ids)[:, ::BLOCK] // BLOCK  # [B, Qb]: the earliest block any row of this query block sees
        qb = torch.arange(self.nb, device=dev)
        j, i = qb[None, None, :], qb[None, :, None]
        seen = (j <= i) & (j >= first_kv[:, :, None])  # [B, Qb, KVb]
        # Wholly visible: below the diagonal, and the key block's first row shares a document with
        # the query block's last row (documents are contiguous, so every row in between does too).
        full = seen & (j < i) & (doc_ids[:, None, ::BLOCK] == doc_ids[:, BLOCK - 1 :: BLOCK, None])
        partial = seen & ~full
        self.kv, self.full_kv = _lists(partial), _lists(full)
        self.q, self.full_q = _lists(partial.transpose(1, 2)), _lists(full.transpose(1, 2))
        self.qb = qb
        docs = doc_ids

        def mask_mod(bi, h, q_idx, kv_idx):
            block, col = kv_idx // t, kv_idx % t
            return ((block == 0) & (col <= q_idx) & (docs[bi, col] == docs[bi, q_idx])) | ((block > 0) & (col == q_idx))

        self.mask_mod = mask_mod

    def for_step(self, step: int) -> BlockMask:
        nb, k = self.nb, step
        (count, kv_idx), (full_count, full_idx) = self.kv, self.full_kv
        (q_count, q_idx), (full_q_count, full_q_idx) = self.q, self.full_q
        b = count.shape[0]
        if k:
            # Key lists: step 0's, then block s·nb + i for s = 1..k (partial: row t sees row t).
            pad = kv_idx.new_zeros(b, 1, nb, k * nb)
            kv_idx = torch.cat([kv_idx, pad], -1)
            s = torch.arange(1, k + 1, device=count.device, dtype=torch.int32)
            kv_idx = kv_idx.scatter(-1, (count[..., None] + s - 1).long(), (s * nb + self.qb[:, None]).to(torch.int32).expand(b, 1, nb, k))
            count = count + k
            full_idx = torch.cat([full_idx, pad], -1)
            # Query lists of the diagonal blocks: block s·nb + i is seen by query block i alone.
            diag_q = torch.zeros(b, 1, k * nb, nb, dtype=torch.int32, device=count.device)
            diag_q[..., 0] = self.qb.to(torch.int32).repeat(k)
            q_idx = torch.cat([q_idx, diag_q], -2)
            q_count = torch.cat([q_count, q_count.new_ones(b, 1, k * nb)], -1)
            full_q_idx = torch.cat([full_q_idx, torch.zeros_like(diag_q)], -2)
            full_q_count = torch.cat([full_q_count, full_q_count.new_zeros(b, 1, k * nb)], -1)
        return BlockMask(
            seq_lengths=(self.t, (k + 1) * self.t), kv_num_blocks=count, kv_indices=kv_idx,
            full_kv_num_blocks=full_count, full_kv_indices=full_idx, q_num_blocks=q_count, q_indices=q_idx,
            full_q_num_blocks=full_q_count, full_q_indices=full_q_idx, BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=self.mask_mod,
        )


def ttt_flex_attention(q: Tensor, keys: Tensor, values: Tensor, step: int, doc_masks: DocBlockMasks | None = None) -> Tensor | None:
    """q [B, h, T, D], keys/values [B, kv, (step+1)T, D] → [B, h, T, D]; None when flex is unusable
    here. ``doc_masks``: the batch's packed-row masks (None: one sample per row)."""
    global _broken
    if _broken is not None:
        return None
    try:
        mask = ttt_block_mask(q.shape[2], step, str(q.device)) if doc_masks is None else doc_masks.for_step(step)
        return _flex()(q, keys, values, block_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])
    except Exception as e:  # noqa: BLE001 (compile/backend failures vary by version and device)
        if q.device.type != "cuda":
            raise
        _broken = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"flex attention unavailable ({_broken}); TTT attention falls back to SDPA", file=sys.stderr)
        return None
