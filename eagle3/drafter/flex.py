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


def _kv_lists(visible: Tensor) -> tuple[Tensor, Tensor]:
    """Bool [B, Qb, KVb] block visibility → (count [B, 1, Qb], indices [B, 1, Qb, KVb]; the visible ones first, in order)."""
    count = visible.sum(-1, dtype=torch.int32)
    order = torch.argsort((~visible).to(torch.int32), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def ttt_doc_block_mask(doc_ids: Tensor, step: int) -> BlockMask:
    """The TTT mask of a packed row — step-0 block causal within a document, blocks 1..step
    diagonal — for doc_ids [B, T] (T a multiple of 128, each document contiguous)."""
    b, t = doc_ids.shape
    nb = t // BLOCK
    idx = torch.arange(t, device=doc_ids.device)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    doc_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # first row of each row's document
    first_kv = doc_start[:, ::BLOCK] // BLOCK  # [B, Qb]: the earliest block any row of this query block sees
    qb = torch.arange(nb, device=doc_ids.device)
    j, i = qb[None, None, :], qb[None, :, None]
    seen = (j <= i) & (j >= first_kv[:, :, None])  # [B, Qb, KVb]
    # Wholly visible: below the diagonal, and the key block's first row shares a document with
    # the query block's last row (documents are contiguous, so every row in between does too).
    full = seen & (j < i) & (doc_ids[:, None, ::BLOCK] == doc_ids[:, BLOCK - 1 :: BLOCK, None])
    partial = seen & ~full
    diag = torch.eye(nb, dtype=torch.bool, device=doc_ids.device).expand(b, nb, nb)
    partial = torch.cat([partial] + [diag] * step, dim=-1)
    full = torch.cat([full] + [torch.zeros_like(full)] * step, dim=-1)
    docs = doc_ids

    def mask_mod(bi, h, q_idx, kv_idx):
        block, col = kv_idx // t, kv_idx % t
        return ((block == 0) & (col <= q_idx) & (docs[bi, col] == docs[bi, q_idx])) | ((block > 0) & (col == q_idx))

    return BlockMask.from_kv_blocks(*_kv_lists(partial), *_kv_lists(full), BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(t, (step + 1) * t))


def ttt_flex_attention(q: Tensor, keys: Tensor, values: Tensor, step: int, doc_ids: Tensor | None = None) -> Tensor | None:
    """q [B, h, T, D], keys/values [B, kv, (step+1)T, D] → [B, h, T, D]; None when flex is unusable
    here (or for a packed row whose length is not a multiple of 128)."""
    global _broken
    if _broken is not None or (doc_ids is not None and q.shape[2] % BLOCK):
        return None
    try:
        mask = ttt_block_mask(q.shape[2], step, str(q.device)) if doc_ids is None else ttt_doc_block_mask(doc_ids, step)
        return _flex()(q, keys, values, block_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])
    except Exception as e:  # noqa: BLE001 (compile/backend failures vary by version and device)
        if q.device.type != "cuda":
            raise
        _broken = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"flex attention unavailable ({_broken}); TTT attention falls back to SDPA", file=sys.stderr)
        return None
