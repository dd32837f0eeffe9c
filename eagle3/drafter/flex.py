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

import math
import sys
from functools import lru_cache

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

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


LIST_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def doc_block_lists(doc_ids: Tensor, steps: int) -> list[dict[str, Tensor]]:
    """The TTT block lists of packed rows doc_ids [B, T] (T a multiple of 128, each document
    contiguous), for steps 0..steps-1: step k's mask is step 0's — causal within a document —
    plus the diagonal of each of the k later blocks.

    Step 0's lists (which key blocks each query block sees, partly or wholly, and the
    transposes the backward pass walks) are derived once; each later step appends its
    diagonal blocks. Every tensor is contiguous int32: the training loop builds them on the
    CPU where the batch is made (:func:`pack_block_lists`), so the GPU's forward launches none
    of these small kernels."""
    from eagle3.drafter.model import doc_start_rows

    t = doc_ids.shape[1]
    nb, dev, b = t // BLOCK, doc_ids.device, doc_ids.shape[0]
    first_kv = doc_start_rows(doc_ids)[:, ::BLOCK] // BLOCK  # [B, Qb]: the earliest block any row of this query block sees
    qb = torch.arange(nb, device=dev)
    j, i = qb[None, None, :], qb[None, :, None]
    seen = (j <= i) & (j >= first_kv[:, :, None])  # [B, Qb, KVb]
    # Wholly visible: below the diagonal, and the key block's first row shares a document with
    # the query block's last row (documents are contiguous, so every row in between does too).
    full = seen & (j < i) & (doc_ids[:, None, ::BLOCK] == doc_ids[:, BLOCK - 1 :: BLOCK, None])
    partial = seen & ~full
    (count, kv_idx), (full_count, full_idx) = _lists(partial), _lists(full)
    (q_count, q_idx), (full_q_count, full_q_idx) = _lists(partial.transpose(1, 2)), _lists(full.transpose(1, 2))
    out = [dict(zip(LIST_NAMES, (count, kv_idx, full_count, full_idx, q_count, q_idx, full_q_count, full_q_idx)))]
    for k in range(1, steps):
        # Key lists: step 0's, then block s·nb + i for s = 1..k (partial: row t sees row t).
        pad = kv_idx.new_zeros(b, 1, nb, k * nb)
        s = torch.arange(1, k + 1, device=dev, dtype=torch.int32)
        kv_k = torch.cat([kv_idx, pad], -1).scatter(
            -1, (count[..., None] + s - 1).long(), (s * nb + qb[:, None]).to(torch.int32).expand(b, 1, nb, k))
        # Query lists of the diagonal blocks: block s·nb + i is seen by query block i alone.
        diag_q = torch.zeros(b, 1, k * nb, nb, dtype=torch.int32, device=dev)
        diag_q[..., 0] = qb.to(torch.int32).repeat(k)
        out.append(dict(zip(LIST_NAMES, (
            count + k, kv_k, full_count, torch.cat([full_idx, pad], -1),
            torch.cat([q_count, q_count.new_ones(b, 1, k * nb)], -1), torch.cat([q_idx, diag_q], -2),
            torch.cat([full_q_count, full_q_count.new_zeros(b, 1, k * nb)], -1), torch.cat([full_q_idx, torch.zeros_like(diag_q)], -2),
        ))))
    return out


BlockLayout = list[list[tuple[int, tuple[int, ...]]]]  # per step, per list (in LIST_NAMES order): (offset, shape)


def pack_block_lists(doc_ids: Tensor, steps: int, pin: bool = False) -> tuple[Tensor, BlockLayout] | None:
    """:func:`doc_block_lists` of packed rows doc_ids [B, T] for ``steps`` steps, every list in one
    flat int32 tensor (one copy to the GPU; page-locked with ``pin``), and where each lies in it.
    None when T is not whole 128-token blocks (flex is not used for such rows)."""
    if doc_ids.shape[1] % BLOCK:
        return None
    parts, layout, at = [], [], 0
    for step in doc_block_lists(doc_ids, steps):
        row = []
        for name in LIST_NAMES:
            x = step[name].to(torch.int32).contiguous()
            parts.append(x.view(-1))
            row.append((at, tuple(x.shape)))
            at += x.numel()
        layout.append(row)
    flat = torch.cat(parts)
    return (flat.pin_memory() if pin else flat), layout


def unpack_block_lists(flat: Tensor, layout: BlockLayout) -> list[dict[str, Tensor]]:
    """:func:`pack_block_lists` undone on the flat tensor's device: contiguous views, no kernels."""
    return [dict(zip(LIST_NAMES, (flat[at : at + math.prod(shape)].view(shape) for at, shape in row))) for row in layout]


class DocBlockMasks:
    """The TTT block masks of one batch of packed rows doc_ids [B, T], one per step, from
    :func:`doc_block_lists` (derived here on first use, or handed over made on the host)."""

    def __init__(self, doc_ids: Tensor, lists: list[dict[str, Tensor]] | None = None, steps: int = 1) -> None:
        self.t = doc_ids.shape[1]
        self.doc_ids, self.lists, self.steps = doc_ids, lists, steps
        self.host_made = lists is not None
        docs, t = doc_ids, self.t

        def mask_mod(bi, h, q_idx, kv_idx):
            block, col = kv_idx // t, kv_idx % t
            return ((block == 0) & (col <= q_idx) & (docs[bi, col] == docs[bi, q_idx])) | ((block > 0) & (col == q_idx))

        self.mask_mod = mask_mod

    def drop_host_lists(self) -> None:
        self.lists, self.host_made = None, False

    def for_step(self, step: int) -> BlockMask:
        if self.lists is None or step >= len(self.lists):
            self.lists = doc_block_lists(self.doc_ids, max(step + 1, self.steps))
        lists = self.lists[step]
        return BlockMask(seq_lengths=(self.t, (step + 1) * self.t), BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=self.mask_mod,
                         **{name: lists[name] for name in LIST_NAMES})


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
