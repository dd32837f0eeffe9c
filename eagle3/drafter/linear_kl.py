"""Fused draft head + KL: ``sum_r KL(p_r || softmax(x_r W^T))`` without keeping logits.

The draft logits of one chunk of rows live only inside that chunk: forward computes
the KL, the top-1 hits and, right away, the gradient of the KL sum with respect to the
logits (``softmax(q) - p``), turns it into the gradients of ``x`` and ``W`` and drops
it. Backward only scales those by the incoming gradient. Compared with autograd over
checkpointed logits this saves the recomputation of the head in backward and never
materialises a [rows, vocab] tensor beyond one chunk.

Teacher logits are given (the target's lm_head restricted to the draft vocab, applied
to the stored final hidden state once per batch, not once per TTT step).

With ``compiled`` (CUDA training) the per-chunk math (two log-softmaxes, the KL, the
argmaxes and the logit gradient) runs through ``torch.compile`` so it fuses into a few
kernels; if that cannot compile on this machine the same function runs eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.drafter.compiled import Compiled


def chunk_kl(x: Tensor, weight: Tensor, teacher: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [R, H], weight [N, H], teacher logits [R, N] (same compute dtype) →
    (KL sum fp32 scalar, hits int64 scalar, d KL_sum / d logits [R, N] in x's dtype)."""
    logq = F.log_softmax((x @ weight.T).float(), dim=-1)  # [R, N]
    logp = F.log_softmax(teacher.float(), dim=-1)  # [R, N]
    p = logp.exp()
    kl = (p * (logp - logq)).sum()
    hits = (logq.argmax(-1) == logp.argmax(-1)).sum()
    return kl, hits, (logq.exp() - p).to(x.dtype)


_compiled_chunk_kl = Compiled(chunk_kl, "draft-head KL", dynamic=True)

# Logits alive at once by default (bf16: 256 MB; the compiled chunk keeps no fp32 copy): 8,192 rows
# of a 16K draft vocab, 4,096 of 32K. Fewer chunks: fewer launches and no fp32 sum of the head's gradient.
CHUNK_LOGITS = 1 << 27


def default_chunk_rows(vocab: int) -> int:
    return max(256, CHUNK_LOGITS // max(1, vocab))


class LinearKL(torch.autograd.Function):
    """(x [R, H], weight [N, H], teacher [R, N], chunk_rows) → (KL sum, hits); grads for x and weight."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, teacher: Tensor, chunk_rows: int, compiled: bool) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        cdt = teacher.dtype  # compute dtype: bf16 under CUDA autocast, else float32
        w = weight.to(cdt)
        xc_all = x.to(cdt)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(xc_all) if need_x else None
        one_chunk = x.shape[0] <= chunk_rows
        # Several chunks sum the head's gradient in float32; one chunk's bf16 matmul already
        # accumulates in float32 and rounds once, as the saved bf16 copy would.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w and not one_chunk else None
        kl: Tensor | None = None
        hits: Tensor | None = None
        with torch.autocast(x.device.type, enabled=False):
            for s in range(0, x.shape[0], chunk_rows):
                xc, tc = xc_all[s : s + chunk_rows], teacher[s : s + chunk_rows]
                k, n, g = (_compiled_chunk_kl if compiled else chunk_kl)(xc, w, tc)  # g [Rc, N]
                kl, hits = (k, n) if kl is None else (kl + k, hits + n)
                if grad_x is not None:
                    torch.mm(g, w, out=grad_x[s : s + chunk_rows])  # [Rc, H]
                if need_w and one_chunk:
                    grad_w = g.T @ xc  # [N, H] in the compute dtype
                elif grad_w is not None:
                    grad_w += (g.T @ xc).float()  # [N, H]
        if kl is None:  # no rows
            kl, hits = torch.zeros((), dtype=torch.float32, device=x.device), torch.zeros((), dtype=torch.long, device=x.device)
        # Kept until backward, once per TTT step: in the compute dtype (bf16 under autocast, what
        # autograd's own bf16 matmul backward would give), half the bytes of the float32 sum
        # (8B-sized drafter: 7 steps x 0.26 GB instead of 7 x 0.52 GB).
        ctx.save_for_backward(grad_x, None if grad_w is None else grad_w.to(cdt))
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.mark_non_differentiable(hits)
        return kl, hits

    @staticmethod
    def backward(ctx, g_kl: Tensor, g_hits: Tensor | None):  # type: ignore[override]
        grad_x, grad_w = ctx.saved_tensors
        gx = None if grad_x is None else (grad_x.float() * g_kl).to(ctx.x_dtype)
        gw = None if grad_w is None else (grad_w.float() * g_kl).to(ctx.w_dtype)
        return gx, gw, None, None, None


def linear_kl(x: Tensor, weight: Tensor, teacher: Tensor, chunk_rows: int | None = None, compiled: bool = False) -> tuple[Tensor, Tensor]:
    """Sum over rows of KL(softmax(teacher) || softmax(x @ weight.T)) and the top-1 hits;
    ``chunk_rows``: rows of logits at once (None: :func:`default_chunk_rows`);
    ``compiled``: the per-chunk math through torch.compile (CUDA training)."""
    chunk_rows = chunk_rows or default_chunk_rows(weight.shape[0])
    if x.shape[0] != teacher.shape[0] or weight.shape[0] != teacher.shape[1]:
        raise ValueError(f"linear_kl: x {tuple(x.shape)}, weight {tuple(weight.shape)}, teacher {tuple(teacher.shape)} do not match")
    return LinearKL.apply(x, weight, teacher, chunk_rows, compiled)
