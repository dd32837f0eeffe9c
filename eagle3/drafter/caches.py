"""How a drafter step's attention sees earlier rows: :class:`KVCache` for token-by-token
decoding, :class:`TTTCache` for training-time test, where step k at row t attends causally
to rows <= t of step 0 and to row t of steps 1..k (exactly what decoding sees).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.drafter.flex import ttt_flex_attention
from eagle3.drafter.masks import BLOCK, DocBlockMasks, ttt_mask, unpack_block_lists


class KVCache:
    """Keys/values of every row seen so far, for decoding; new rows attend to all of them + causally."""

    def __init__(self) -> None:
        self.k: Tensor | None = None  # [B, kv, S, D]
        self.v: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else int(self.k.shape[2])

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        past = self.length
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        t = q.shape[2]
        if past == 0:
            return F.scaled_dot_product_attention(q, self.k, self.v, is_causal=True, enable_gqa=True)
        rows = torch.arange(t, device=q.device)[:, None] + past
        mask = torch.arange(past + t, device=q.device)[None, :] <= rows  # [T, S+T]
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, enable_gqa=True)


class TTTCache:
    """Per-step key/value blocks [B, kv, T, D] for training-time test.

    ``backend``: "sdpa" (dense bool mask over all blocks; CPU and fallback) or "flex"
    (flex attention with a block-sparse mask that skips the empty off-diagonal blocks).
    ``doc_ids`` [B, T]: packed rows, where a row attends only to its own document; their flex
    block lists for ``steps`` steps are derived here once, or come made with the batch on the
    host (``block_lists``: :func:`eagle3.drafter.masks.pack_block_lists`, on doc_ids' device).
    """

    def __init__(self, backend: str = "sdpa", doc_ids: Tensor | None = None, steps: int = 1,
                 block_lists: tuple[Tensor, Any] | None = None) -> None:
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.backend = backend
        self.doc_ids, self.steps, self.block_lists = doc_ids, steps, block_lists
        self._doc_masks = None  # flex's block masks of the packed rows, one per step

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.k.append(k)
        self.v.append(v)
        step, t, docs = len(self.k) - 1, q.shape[2], self.doc_ids
        if step == 0 and docs is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        keys, values = torch.cat(self.k, dim=2), torch.cat(self.v, dim=2)  # [B, kv, (step+1)T, D]
        if self.backend == "flex":
            if docs is None or t % BLOCK == 0:  # packed rows of whole blocks only
                if docs is not None and self._doc_masks is None:
                    lists = None if self.block_lists is None else unpack_block_lists(*self.block_lists)
                    self._doc_masks = DocBlockMasks(docs, lists, self.steps)
                out = ttt_flex_attention(q, keys, values, step, self._doc_masks)
                if out is not None:
                    return out
        if q.is_cuda and q.shape[1] != keys.shape[1]:
            # Expanded kv heads keep the masked call on the memory-efficient kernel.
            rep = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=ttt_mask(t, step, q.device, docs), enable_gqa=True)
