"""Which keys each TTT query sees: dense bool masks (SDPA) and flex attention's block masks.

Training-time test step k at row t attends causally to rows <= t of step 0 and to row t
of steps 1..k. Packed rows (several samples in one row, a document id per token) add the
document mask to the step-0 block; their block masks are built per batch straight from
the document boundaries (which 128-token blocks a query block can see, and which of those
lie wholly inside its document), without evaluating the mask at every position.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def doc_start_rows(doc_ids: Tensor) -> Tensor:
    """doc_ids [B, T] (each document contiguous) → [B, T]: the row where each token's document starts."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values


def ttt_mask(t: int, step: int, device: torch.device | None = None, doc_ids: Tensor | None = None) -> Tensor:
    """Bool [T, (step+1)·T]: step-0 block causal, blocks 1..step diagonal (row t sees row t).
    With doc_ids [B, T] (packed rows): [B, 1, T, (step+1)·T], the step-0 block also within a document."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    if doc_ids is None:
        return torch.cat([causal] + [eye] * step, dim=1)
    same = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal  # [B, T, T]
    return torch.cat([same] + [eye.expand_as(same)] * step, dim=2)[:, None]


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
