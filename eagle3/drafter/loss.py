"""The training-time-test (TTT) objective.

Alignment (row t of a sample x_0..x_{T-1}; z_j = target logits at position j, which
predict x_{j+1}; h_t = the aux hidden states at position t):

    step 0: hidden fc(h_t),               token x_{t+1},   position t,   teacher z_{t+1}
    step k: hidden = step k-1's output,   token x_{t+1+k}, position t+k, teacher z_{t+1+k}

which is what vLLM does when drafting: the target's hidden at t plus the token it just
sampled, then the drafter's own output, one position further each step. A prediction
counts when the token it predicts, x_{t+2+k}, is loss-masked (an assistant token);
rows whose targets fall off the end are masked. In a packed row (``doc_ids``, several
samples one after another) positions count from each sample's start, attention stays
inside the sample, and a row counts only when its target is of the same sample. The
teacher is the target's lm_head restricted to the draft vocab, applied to the stored final
hidden state once per batch (every step is taught by the same set of positions); the
draft head and the KL run fused, chunk by chunk (:mod:`eagle3.drafter.linear_kl`), only
over counted rows.

Loss of step k: forward KL(p_teacher || q_draft) averaged over counted rows; total
loss = sum_k decay**k · loss_k. Accuracy of step k: argmax q == argmax p.

Accuracy per step is teacher-forced: step k is fed the true tokens whatever steps before
it predicted. Decoding accepts step k only after steps 0..k-1 were accepted, so with
``chain=True`` (held-out evaluation) the objective also counts the *chained* accuracy —
step k right among the rows where steps 0..k-1 were right — which is what the evaluate
stage's conditional acceptance per position measures, and how often step k predicts the
same token as step 0 (a chain that does not advance repeats step 0's token at every step:
high teacher-forced accuracy on repetitive text, near-zero chained accuracy).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from eagle3.drafter.caches import TTTCache
from eagle3.drafter.linear_kl import linear_kl
from eagle3.drafter.masks import doc_start_rows
from eagle3.drafter.model import Eagle3Drafter


def shift_left(x: Tensor, k: int, fill: float | int = 0) -> Tensor:
    """[B, T, ...] → rows t hold x[t+k]; the last k rows are ``fill``."""
    if k == 0:
        return x
    pad = torch.full((x.shape[0], min(k, x.shape[1]), *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, k:], pad], dim=1)


def doc_positions(doc_ids: Tensor) -> Tensor:
    """doc_ids [B, T] (each document contiguous) → each token's position inside its document."""
    return torch.arange(doc_ids.shape[1], device=doc_ids.device) - doc_start_rows(doc_ids)


class TTTInputs:
    """Every TTT step's inputs of one batch, derived once (a few kernels a batch, not a few a step):
    step k's tokens and counted rows are views of the batch padded by steps + 1 columns.

    Row t of step k is fed x_{t+1+k} at position t+k and predicts x_{t+2+k}; it counts when that
    token is loss-masked and, in a packed row (``doc_ids``), of row t's own document."""

    def __init__(self, input_ids: Tensor | None, loss_mask: Tensor, steps: int, doc_ids: Tensor | None = None) -> None:
        """``input_ids`` None: the counted rows alone (:func:`row_counts`)."""
        b, t = loss_mask.shape
        self.t, self.steps = t, steps
        self.ids = None if input_ids is None else torch.cat([input_ids, input_ids.new_zeros(b, steps + 1)], 1)  # [B, T+S+1]
        mask = torch.cat([loss_mask.bool(), loss_mask.new_zeros(b, steps + 1, dtype=torch.bool)], 1)
        counted = mask.unfold(1, t, 1)[:, 2 : 2 + steps]  # [B, S, T] views: window j is columns j..j+T-1
        if doc_ids is not None:
            docs = torch.cat([doc_ids, doc_ids.new_full((b, steps + 1), -1)], 1).unfold(1, t, 1)[:, 2 : 2 + steps]
            counted = counted & (docs == doc_ids[:, None]) & (doc_ids >= 0)[:, None]
        self.counted_all = counted.transpose(0, 1).contiguous()  # [S, B, T]: step k's rows are one block
        self.positions0 = None
        if input_ids is not None:
            self.positions0 = (torch.arange(t, device=input_ids.device).expand(b, t) if doc_ids is None
                               else doc_positions(doc_ids))

    def counted(self, step: int) -> Tensor:
        return self.counted_all[step]

    def step(self, step: int) -> tuple[Tensor, Tensor, Tensor]:
        """(tokens [B, T], positions [B, T], counted [B, T] bool) of TTT step ``step``."""
        assert self.ids is not None and self.positions0 is not None, "TTTInputs made without input_ids"
        return self.ids[:, 1 + step : 1 + step + self.t], self.positions0 + step, self.counted_all[step]


def counted_rows(loss_mask: Tensor, step: int, doc_ids: Tensor | None = None) -> Tensor:
    """Bool [B, T]: the rows TTT step ``step`` is taught at (:class:`TTTInputs`)."""
    return TTTInputs(None, loss_mask, step + 1, doc_ids).counted(step)


def step_inputs(input_ids: Tensor, loss_mask: Tensor, step: int, doc_ids: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(tokens [B, T], positions [B, T], counted [B, T] bool) of TTT step ``step`` alone (:class:`TTTInputs`)."""
    return TTTInputs(input_ids, loss_mask, step + 1, doc_ids).step(step)


@dataclass
class TTTResult:
    loss: Tensor  # scalar, weighted sum over steps (with grad)
    step_loss: Tensor  # [S] detached mean KL per step
    step_acc: Tensor  # [S] detached top-1 agreement per step
    step_count: Tensor  # [S] counted rows per step
    chain: Tensor | None = None  # [4, S] with chain=True: see chain_sums


def rows_where(flags: Tensor, count: int | None) -> Tensor:
    """Indices of the set entries of a flat bool tensor. With ``count`` known beforehand (from
    :func:`row_counts` on the host's copy of the batch) the GPU is not waited for: nonzero()
    must learn the result's size from the device, a host synchronisation per call."""
    if count is None:
        return flags.nonzero().squeeze(-1)
    return torch.nonzero_static(flags, size=count).squeeze(-1)


def teacher_needed(loss_mask: Tensor) -> Tensor:
    """Flat bool [B·T]: the positions whose teacher logits any TTT step uses (see :func:`teacher_logits`)."""
    return shift_left(loss_mask, 1).bool().flatten()


def row_counts(loss_mask: Tensor, doc_ids: Tensor | None, steps: int) -> list[int]:
    """[teacher positions, counted rows of step 0, ..., of step steps-1] of one batch: computed
    where the batch is made (host memory), so the GPU's forward never stops to count them."""
    counted = TTTInputs(None, loss_mask, steps, doc_ids).counted_all
    return [int(teacher_needed(loss_mask).sum())] + counted.sum(dim=(1, 2)).tolist()


def teacher_logits(teacher_head: Tensor, final_hidden: Tensor, loss_mask: Tensor, count: int | None = None,
                   temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Teacher logits of every position any TTT step is taught by, computed once per batch.

    Step k at row t is taught by z_{t+1+k} and counts iff loss_mask[t+2+k]: so position j
    is needed iff loss_mask[j+1], the same set for every step. → (logits [R0, N] in the
    head's dtype, divided by ``temperature``, row_of [B·T] int64: the logits row of flat
    position j, or -1). ``count``: R0 when already known (:func:`row_counts`).
    """
    needed = teacher_needed(loss_mask)  # [B·T]
    idx = rows_where(needed, count)  # [R0]
    with torch.no_grad():
        f = final_hidden.flatten(0, 1).index_select(0, idx).to(teacher_head.dtype)  # [R0, Ht]
        logits = f @ teacher_head.T  # [R0, N]
        if temperature != 1.0:
            logits.div_(temperature)  # in place: a second [R0, N] buffer would be ~1 GB at 16K rows x 32K vocab
    row_of = torch.full((needed.numel(),), -1, dtype=torch.long, device=loss_mask.device)
    row_of[idx] = torch.arange(idx.numel(), device=loss_mask.device)
    return logits, row_of


def step_kl(
    drafter: Eagle3Drafter, teacher: Tensor, row_of: Tensor, normed: Tensor, counted: Tensor, step: int, chunk_rows: int | None,
    compiled: bool = False, count: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sum of KL, hits and count over the counted rows of TTT step ``step``.

    normed [B, T, H]: the draft head's input, norm(drafter output); teacher/row_of from
    :func:`teacher_logits`. Row t's teacher is position t+1+step of the same sample (counted
    rows never run off the end). ``count``: how many rows are counted, when already known
    (:func:`row_counts`).
    """
    idx = rows_where(counted.flatten(), count)  # [R]
    if idx.numel() == 0:
        # Zero, but through every weight: a batch with nothing counted still backpropagates
        # to all parameters, which DDP needs to finish its gradient reduction.
        zero = 0.0 * drafter.lm_head(normed[:1, :1]).float().sum()
        return zero, torch.zeros((), dtype=torch.long, device=normed.device), torch.zeros((), dtype=torch.long, device=normed.device)
    x = normed.flatten(0, 1).index_select(0, idx)  # [R, H]
    t = teacher.index_select(0, row_of.index_select(0, idx + 1 + step))  # [R, N]
    kl, hits = linear_kl(x, drafter.lm_head.weight, t, chunk_rows, compiled)
    return kl, hits, torch.full((), idx.numel(), dtype=torch.long, device=normed.device)  # no host-to-device copy


def chain_sums(hits: Tensor, counted: Tensor, preds: Tensor) -> Tensor:
    """hits, counted [S, R] bool and preds [S, R] argmax of S steps at R rows → [4, S] long:
    rows right at step k among row 1's; rows counted at steps 0..k and right at steps 0..k-1;
    rows whose step-k argmax is step 0's among row 3's; rows counted at step 0 and at step k."""
    h, c = hits.long(), counted.long()
    right_before = torch.cat([torch.ones_like(h[:1]), h[:-1].cumprod(0)])
    before = right_before * c.cumprod(0)
    both = c * c[:1]
    return torch.stack([(before * h).sum(1), before.sum(1), (both * (preds == preds[:1])).sum(1), both.sum(1)])


def chain_rates(sums: Tensor) -> tuple[list[float], list[float]]:
    """:func:`chain_sums` (summed over batches and ranks) → (chained accuracy per step, share of
    rows whose argmax repeats step 0's per step)."""
    d = sums.double()
    return (d[0] / d[1].clamp_min(1)).tolist(), (d[2] / d[3].clamp_min(1)).tolist()


class ChainCounter:
    """Per-step hits and argmaxes of one batch's counted rows (no grad), for :func:`chain_sums`."""

    def __init__(self) -> None:
        self.hits: list[Tensor] = []
        self.counted: list[Tensor] = []
        self.preds: list[Tensor] = []

    @torch.no_grad()
    def step(self, drafter: Eagle3Drafter, teacher: Tensor, row_of: Tensor, normed: Tensor, counted: Tensor, k: int) -> None:
        """normed [B, T, H]: the draft head's input at TTT step k (norm of the drafter's output)."""
        flat = counted.flatten()
        idx = flat.nonzero().squeeze(-1)
        pred = drafter.lm_head(normed.flatten(0, 1).index_select(0, idx)).argmax(-1)
        gold = teacher.index_select(0, row_of.index_select(0, idx + 1 + k)).argmax(-1)
        preds = torch.full(flat.shape, -1, dtype=torch.long, device=flat.device)
        preds[idx] = pred
        hits = torch.zeros_like(flat, dtype=torch.bool)
        hits[idx] = pred == gold
        self.hits.append(hits)
        self.counted.append(flat.bool())
        self.preds.append(preds)

    def sums(self) -> Tensor:
        return chain_sums(torch.stack(self.hits), torch.stack(self.counted), torch.stack(self.preds))


def ttt_loss(
    drafter: Eagle3Drafter,
    teacher_head: Tensor,
    input_ids: Tensor,
    aux_hidden: Tensor,
    final_hidden: Tensor,
    loss_mask: Tensor,
    steps: int = 7,
    decay: float = 0.8,
    chunk_rows: int | None = None,
    attention: str = "sdpa",
    compiled: bool = False,
    chain: bool = False,
    doc_ids: Tensor | None = None,
    counts: list[int] | None = None,
    block_lists: tuple[Tensor, Any] | None = None,
    temperature: float = 1.0,
) -> TTTResult:
    """input_ids [B, T], aux_hidden [B, T, 3Ht], final_hidden [B, T, Ht], loss_mask [B, T];
    teacher_head [N, Ht] = the target lm_head rows of the draft vocab; doc_ids [B, T] for
    packed rows (None: one sample per row); counts: :func:`row_counts` of the batch, when
    the caller has them (no host synchronisation per step); block_lists: the packed rows'
    flex block lists made with the batch (:func:`eagle3.drafter.masks.pack_block_lists`);
    temperature: the teacher is softmax(z / temperature) over the draft vocab (below 1:
    sharper, toward the target's top token)."""
    if counts is not None and len(counts) < steps + 1:
        raise ValueError(f"row counts for {len(counts) - 1} TTT steps, {steps} needed")
    cache = TTTCache(attention, doc_ids, steps, block_lists)
    teacher, row_of = teacher_logits(teacher_head, final_hidden, loss_mask, None if counts is None else counts[0], temperature)
    hidden = drafter.project_aux(aux_hidden)  # [B, T, H]
    inputs = TTTInputs(input_ids, loss_mask, steps, doc_ids)
    kls, hits, rows = [], [], []
    counter = ChainCounter() if chain else None
    for k in range(steps):
        tokens, positions, counted = inputs.step(k)
        hidden, normed = drafter.step_hidden_normed(tokens, hidden, positions, cache)  # [B, T, H] each
        if counter is not None:
            counter.step(drafter, teacher, row_of, normed, counted, k)
        kl, h, n = step_kl(drafter, teacher, row_of, normed, counted, k, chunk_rows, compiled,
                           None if counts is None else counts[1 + k])
        kls.append(kl)
        hits.append(h)
        rows.append(n)
    # The steps' losses weighed and summed in a few kernels, not a few per step.
    step_count = torch.stack(rows)
    denom = step_count.clamp_min(1)
    step_loss = torch.stack(kls) / denom
    weights = torch.logspace(0, steps - 1, steps, base=decay, device=step_loss.device, dtype=step_loss.dtype)  # decay**k
    return TTTResult((step_loss * weights).sum(), step_loss.detach(), torch.stack(hits).float() / denom, step_count,
                     None if counter is None else counter.sums())


def noised_features(aux_hidden: Tensor, layer_size: int, amplitude: float) -> Tensor:
    """aux_hidden [..., L * layer_size], L aux layers side by side, plus uniform noise U(-a, a) * rms(h) on each
    layer's hidden state h of each token, a = amplitude (EAGLE-1's feature noise, scaled per layer: the target's
    layers differ in scale by orders of magnitude). In aux_hidden's dtype; zero rows (padding) stay zero."""
    if aux_hidden.shape[-1] % layer_size:
        raise ValueError(f"aux hidden width {aux_hidden.shape[-1]} is not a multiple of the target's hidden size "
                         f"{layer_size}")
    h = aux_hidden.unflatten(-1, (aux_hidden.shape[-1] // layer_size, layer_size)).float()
    scale = h.square().mean(-1, keepdim=True).sqrt_().mul_(amplitude)
    return torch.rand_like(h).mul_(2).sub_(1).mul_(scale).add_(h).to(aux_hidden.dtype).flatten(-2)


class TTTObjective(nn.Module):
    """The drafter plus its objective as one module, so DDP/FSDP wrap a single forward.

    ``compiled``: torch.compile the drafter layer's halves and the draft-head KL (CUDA
    training; each falls back to eager if it cannot compile here)."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float, chunk_rows: int | None = None, attention: str = "sdpa",
                 compiled: bool = False, temperature: float = 1.0, feature_noise: float = 0.0) -> None:
        super().__init__()
        self.drafter = drafter
        self.steps, self.decay, self.chunk_rows, self.attention = steps, decay, chunk_rows, attention
        self.temperature, self.feature_noise = temperature, feature_noise
        self.compiled = compiled
        if compiled:
            drafter.midlayer.compile()
        self.teacher_head: Tensor | None = None  # [N, Ht], not a buffer: DDP must not broadcast it

    @contextmanager
    def eager(self) -> Iterator[None]:
        """Uncompiled, SDPA attention inside: for a few held-out batches, compiling no-grad
        variants of every graph would cost more than it saves."""
        saved = self.compiled, self.attention
        self.compiled, self.attention = False, "sdpa"
        try:
            with self.drafter.midlayer.eager():
                yield
        finally:
            self.compiled, self.attention = saved

    def forward(self, input_ids: Tensor, aux_hidden: Tensor, final_hidden: Tensor, loss_mask: Tensor,
                doc_ids: Tensor | None = None, chain: bool = False, counts: list[int] | None = None,
                block_lists: tuple[Tensor, Any] | None = None) -> tuple[Tensor, ...]:
        """→ (loss, step_loss, step_acc, step_count), and the [4, S] chain counts with ``chain``."""
        assert self.teacher_head is not None, "set TTTObjective.teacher_head first"
        if self.training and self.feature_noise > 0:
            aux_hidden = noised_features(aux_hidden, final_hidden.shape[-1], self.feature_noise)
        r = ttt_loss(
            self.drafter, self.teacher_head, input_ids, aux_hidden, final_hidden, loss_mask,
            self.steps, self.decay, self.chunk_rows, self.attention, self.compiled, chain, doc_ids, counts, block_lists,
            self.temperature,
        )
        if r.chain is not None:
            return r.loss, r.step_loss, r.step_acc, r.step_count, r.chain
        return r.loss, r.step_loss, r.step_acc, r.step_count
