"""TTT attention through flex attention: the off-diagonal blocks are empty and skipped
(its block masks are built in :mod:`eagle3.drafter.masks`).

Used on CUDA, where ``torch.compile`` turns flex attention into a fused kernel; the
dense-mask SDPA path in ``caches.TTTCache`` is the reference and the CPU path. If the
compiled kernel cannot be built on this machine, the first failure is reported once
and every later call takes the SDPA path (same math, more memory).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from eagle3.drafter.masks import DocBlockMasks, ttt_block_mask

_compiled = None
_broken: str | None = None
_host_lists_broken: str | None = None


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


def ttt_flex_attention(q: Tensor, keys: Tensor, values: Tensor, step: int, doc_masks: DocBlockMasks | None = None) -> Tensor | None:
    """q [B, h, T, D], keys/values [B, kv, (step+1)T, D] → [B, h, T, D]; None when flex is unusable
    here. ``doc_masks``: the batch's packed-row masks (None: one sample per row)."""
    global _broken, _host_lists_broken
    if _broken is not None:
        return None
    if doc_masks is not None and doc_masks.host_made and _host_lists_broken is not None:
        doc_masks.drop_host_lists()
    try:
        mask = ttt_block_mask(q.shape[2], step, str(q.device)) if doc_masks is None else doc_masks.for_step(step)
        return _flex()(q, keys, values, block_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])
    except Exception as e:  # noqa: BLE001 (compile/backend failures vary by version and device)
        if q.device.type != "cuda":
            raise
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if doc_masks is not None and doc_masks.host_made:
            # Lists made with the batch are views of one tensor; should a compiler refuse them,
            # derive them here instead (more kernels a step) before giving up on flex.
            _host_lists_broken = why
            print(f"flex attention refused the block lists made with the batch ({why}); they are derived on the GPU",
                  file=sys.stderr)
            doc_masks.drop_host_lists()
            return ttt_flex_attention(q, keys, values, step, doc_masks)
        _broken = why
        print(f"flex attention unavailable ({_broken}); TTT attention falls back to SDPA", file=sys.stderr)
        return None
