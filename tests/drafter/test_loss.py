import torch
import torch.nn.functional as F

from eagle3.drafter.loss import shift_left, step_inputs, ttt_loss
from tests.drafter.helpers import draft_ids, teacher_batch, tiny_drafter


def test_step_alignment():
    ids = torch.arange(10, 16).view(1, 6)  # x_0..x_5
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]], dtype=torch.uint8)
    tokens, positions, counted = step_inputs(ids, mask, 1)
    assert tokens.tolist() == [[12, 13, 14, 15, 0, 0]]  # row t gets x_{t+2} at step 1
    assert positions.tolist() == [[1, 2, 3, 4, 5, 6]]  # position t+1
    assert counted.tolist() == [[True, True, False, False, False, False]]  # predicts x_{t+3}: masked 3,4 (5 is 0)
    assert shift_left(torch.ones(1, 2, 3), 5).shape == (1, 2, 3)


def test_loss_matches_full_vocab_reference_and_chunking():
    """Teacher = softmax of the target's full logits restricted to the draft vocab; chunking changes nothing."""
    target, ids, aux, final, logits = teacher_batch()
    keep = draft_ids()
    head = target.lm_head.weight.detach()[keep]
    mask = torch.ones_like(ids, dtype=torch.uint8)
    mask[0, :5] = 0
    m = tiny_drafter()
    r1 = ttt_loss(m, head, ids, aux, final, mask, steps=3, chunk_rows=7)
    g1 = torch.autograd.grad(r1.loss, m.fc.weight)[0]
    r2 = ttt_loss(m, head, ids, aux, final, mask, steps=3, chunk_rows=10_000)
    g2 = torch.autograd.grad(r2.loss, m.fc.weight)[0]
    torch.testing.assert_close(r1.step_loss, r2.step_loss)
    torch.testing.assert_close(g1, g2)
    # Reference for step 0 from the target's own logits: row t is taught by z_{t+1}, counted if mask[t+2].
    with torch.no_grad():
        hidden = m.project_aux(aux)
        tokens, positions, counted = step_inputs(ids, mask, 0)
        out, q, _ = m.step(tokens, hidden, positions)
        p = F.softmax(shift_left(logits, 1)[..., keep], -1)
        kl = (p * (p.log() - F.log_softmax(q, -1))).sum(-1)
        ref = kl[counted].mean()
        acc = (q.argmax(-1) == p.argmax(-1))[counted].float().mean()
    torch.testing.assert_close(r1.step_loss[0], ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(r1.step_acc[0], acc)
    # row 0 counts targets 5..15 (11 rows) at every step; row 1 counts 14 - k
    assert r1.step_count.tolist() == [counted.sum().item(), 11 + 13, 11 + 12] == [25, 24, 23]


def test_loss_decreases_on_a_fixed_batch():
    target, ids, aux, final, _ = teacher_batch(b=2, t=24)
    head = target.lm_head.weight.detach()[draft_ids()]
    mask = torch.ones_like(ids, dtype=torch.uint8)
    m = tiny_drafter().train()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(40):
        r = ttt_loss(m, head, ids, aux, final, mask, steps=3)
        r.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(r.loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::8]


def test_nothing_counted_still_reaches_every_weight():
    target, ids, aux, final, _ = teacher_batch(b=1, t=6)
    m = tiny_drafter()
    r = ttt_loss(m, target.lm_head.weight.detach()[draft_ids()], ids, aux, final, torch.zeros_like(ids), steps=2)
    r.loss.backward()
    assert r.loss.item() == 0.0 and r.step_count.tolist() == [0, 0]
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)
