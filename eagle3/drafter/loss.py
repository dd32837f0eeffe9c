"""The training-time-test (TTT) objective.

Alignment (row t of a sample x_0..x_{T-1}; z_j = target logits at position j, which
predict x_{j+1}; h_t = the aux hidden states at position t):

    step 0: hidden fc(h_t),               token x_{t+1},   position t,   teacher z_{t+1}
    step k: hidden = step k-1's output,   token x_{t+1+k}, position t+k, teacher z_{t+1+k}

which is what vLLM does when drafting: the target's hidden at t plus the token it just
sampled, then the drafter's own output, one position further each step. A prediction
counts when the token it predicts, x_{t+2+k}, is loss-masked (an assistant token);
rows whose targets fall off the end are masked. The teacher is the target's lm_head
restricted to the draft vocab, applied to the stored final hidden state on the fly.

Loss of step k: forward KL(p_teacher || q_draft) averaged over counted rows; total
loss = sum_k decay**k · loss_k. Accuracy of step k: argmax q == argmax p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from eagle3.drafter.model import Eagle3Drafter, TTTCache


def shift_left(x: Tensor, k: int, fill: float | int = 0) -> Tensor:
    """[B, T, ...] → rows t hold x[t+k]; the last k rows are ``fill``."""
    if k == 0:
        return x
    pad = torch.full((x.shape[0], min(k, x.shape[1]), *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, k:], pad], dim=1)


def step_inputs(input_ids: Tensor, loss_mask: Tensor, step: int) -> tuple[Tensor, Tensor, Tensor]:
    """(tokens [B, T], positions [B, T], counted [B, T] bool) of TTT step ``step``."""
    b, t = input_ids.shape
    tokens = shift_left(input_ids, 1 + step)
    positions = torch.arange(step, t + step, device=input_ids.device).expand(b, t)
    counted = shift_left(loss_mask, 2 + step).bool()
    return tokens, positions, counted


@dataclass
class TTTResult:
    loss: Tensor  # scalar, weighted sum over steps (with grad)
    step_loss: Tensor  # [S] detached mean KL per step
    step_acc: Tensor  # [S] detached top-1 agreement per step
    step_count: Tensor  # [S] counted rows per step


def _kl_and_hits(drafter: Eagle3Drafter, teacher_head: Tensor, hidden: Tensor, final: Tensor) -> tuple[Tensor, Tensor]:
    """hidden [R, H] drafter output, final [R, Ht] target final hidden → (sum KL, hits), both scalars."""
    logq = F.log_softmax(drafter.logits(hidden).float(), dim=-1)  # [R, N]
    with torch.no_grad():
        logp = F.log_softmax((final.to(teacher_head.dtype) @ teacher_head.T).float(), dim=-1)  # [R, N]
        hits = (logq.argmax(-1) == logp.argmax(-1)).sum()
    kl = (logp.exp() * (logp - logq)).sum()
    return kl, hits


def step_kl(
    drafter: Eagle3Drafter, teacher_head: Tensor, hidden: Tensor, final: Tensor, counted: Tensor, chunk_rows: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Sum of KL, hits and count over counted rows; logits are built ``chunk_rows`` at a time
    and recomputed in backward, so no [rows, vocab] tensor outlives its chunk."""
    idx = counted.flatten().nonzero().squeeze(-1)  # [R]
    h = hidden.flatten(0, 1).index_select(0, idx)  # [R, H]
    f = final.flatten(0, 1).index_select(0, idx)  # [R, Ht]
    # Zero, but through every weight: a batch with nothing counted still backpropagates
    # to all parameters, which DDP needs to finish its gradient reduction.
    kl = 0.0 * drafter.logits(hidden[:1, :1]).float().sum()
    hits = torch.zeros((), dtype=torch.long, device=hidden.device)
    for s in range(0, idx.numel(), chunk_rows):
        part = (h[s : s + chunk_rows], f[s : s + chunk_rows])
        if torch.is_grad_enabled():
            k, n = checkpoint(_kl_and_hits, drafter, teacher_head, *part, use_reentrant=False)
        else:
            k, n = _kl_and_hits(drafter, teacher_head, *part)
        kl, hits = kl + k, hits + n
    return kl, hits, torch.tensor(idx.numel(), device=hidden.device)


def ttt_loss(
    drafter: Eagle3Drafter,
    teacher_head: Tensor,
    input_ids: Tensor,
    aux_hidden: Tensor,
    final_hidden: Tensor,
    loss_mask: Tensor,
    steps: int = 7,
    decay: float = 0.8,
    chunk_rows: int = 4096,
    attention: str = "sdpa",
) -> TTTResult:
    """input_ids [B, T], aux_hidden [B, T, 3Ht], final_hidden [B, T, Ht], loss_mask [B, T];
    teacher_head [N, Ht] = the target lm_head rows of the draft vocab."""
    cache = TTTCache(attention)
    hidden = drafter.project_aux(aux_hidden)  # [B, T, H]
    losses, accs, counts = [], [], []
    total = hidden.new_zeros((), dtype=torch.float32)
    for k in range(steps):
        tokens, positions, counted = step_inputs(input_ids, loss_mask, k)
        hidden = drafter.step_hidden(tokens, hidden, positions, cache)  # [B, T, H]
        kl, hits, n = step_kl(drafter, teacher_head, hidden, shift_left(final_hidden, 1 + k), counted, chunk_rows)
        denom = n.clamp_min(1)
        loss_k = kl / denom
        total = total + decay**k * loss_k
        losses.append(loss_k.detach())
        accs.append(hits.float() / denom)
        counts.append(n)
    return TTTResult(total, torch.stack(losses), torch.stack(accs), torch.stack(counts))


class TTTObjective(nn.Module):
    """The drafter plus its objective as one module, so DDP/FSDP wrap a single forward."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float, chunk_rows: int = 4096, attention: str = "sdpa") -> None:
        super().__init__()
        self.drafter = drafter
        self.steps, self.decay, self.chunk_rows, self.attention = steps, decay, chunk_rows, attention
        self.teacher_head: Tensor | None = None  # [N, Ht], not a buffer: DDP must not broadcast it

    def forward(self, input_ids: Tensor, aux_hidden: Tensor, final_hidden: Tensor, loss_mask: Tensor) -> tuple[Tensor, ...]:
        assert self.teacher_head is not None, "set TTTObjective.teacher_head first"
        r = ttt_loss(
            self.drafter, self.teacher_head, input_ids, aux_hidden, final_hidden, loss_mask,
            self.steps, self.decay, self.chunk_rows, self.attention,
        )
        return r.loss, r.step_loss, r.step_acc, r.step_count
