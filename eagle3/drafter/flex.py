"""TTT attention through flex attention: the off-diagonal blocks are empty and skipped.

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


def ttt_flex_attention(q: Tensor, keys: Tensor, values: Tensor, step: int) -> Tensor | None:
    """q [B, h, T, D], keys/values [B, kv, (step+1)T, D] → [B, h, T, D]; None when flex is unusable here."""
    global _broken
    if _broken is not None:
        return None
    try:
        mask = ttt_block_mask(q.shape[2], step, str(q.device))
        return _flex()(q, keys, values, block_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])
    except Exception as e:  # noqa: BLE001 (compile/backend failures vary by version and device)
        if q.device.type != "cuda":
            raise
        _broken = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"flex attention unavailable ({_broken}); TTT attention falls back to SDPA", file=sys.stderr)
        return None
