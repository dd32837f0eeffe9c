"""TTT attention through flex attention: the off-diagonal blocks are empty and skipped.

Used on CUDA, where ``torch.compile`` turns flex attention into a fused kernel; the
dense-mask SDPA path in ``model.TTTCache`` is the reference and the CPU path.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

_compiled = None


def _flex():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False) if torch.cuda.is_available() else flex_attention
    return _compiled


@lru_cache(maxsize=64)
def ttt_block_mask(t: int, step: int, device: str) -> BlockMask:
    def mask_mod(b, h, q_idx, kv_idx):
        block, col = kv_idx // t, kv_idx % t
        return ((block == 0) & (col <= q_idx)) | ((block > 0) & (col == q_idx))

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=t, KV_LEN=(step + 1) * t, device=device)


def ttt_flex_attention(q: Tensor, keys: Tensor, values: Tensor, step: int) -> Tensor:
    """q [B, h, T, D], keys/values [B, kv, (step+1)T, D] → [B, h, T, D]."""
    mask = ttt_block_mask(q.shape[2], step, str(q.device))
    return _flex()(q, keys, values, block_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])
