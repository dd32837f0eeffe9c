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


def test_every_step_matches_plain_autograd_reference():
    """Loss and gradients of every TTT step (not only step 0) equal full-logit autograd KL."""
    from eagle3.drafter.caches import TTTCache

    target, ids, aux, final, _ = teacher_batch(b=2, t=20)
    head = target.lm_head.weight.detach()[draft_ids()]
    mask = torch.ones_like(ids, dtype=torch.uint8)
    mask[0, :4] = 0
    m = tiny_drafter()
    params = [p for p in m.parameters() if p.requires_grad]
    r = ttt_loss(m, head, ids, aux, final, mask, steps=4, decay=0.8, chunk_rows=5)
    ours = torch.autograd.grad(r.loss, params)
    cache, hidden, total, z = TTTCache("sdpa"), m.project_aux(aux), 0.0, final @ head.T
    for k in range(4):
        tokens, positions, counted = step_inputs(ids, mask, k)
        hidden = m.step_hidden(tokens, hidden, positions, cache)
        p = F.softmax(shift_left(z, 1 + k), -1)
        kl = (p * (p.clamp_min(1e-30).log() - F.log_softmax(m.logits(hidden), -1))).sum(-1)[counted].mean()
        torch.testing.assert_close(r.step_loss[k], kl.detach(), rtol=1e-4, atol=1e-6)
        total = total + 0.8**k * kl
    for a, b in zip(ours, torch.autograd.grad(total, params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_chained_accuracy_counts_a_step_only_after_every_step_before_was_right():
    """chain=True: per step, rows right at steps 0..k-1 (and counted through k), those also right
    at k, and rows whose argmax repeats step 0's — checked against a brute-force count."""
    from eagle3.drafter.caches import TTTCache

    target, ids, aux, final, _ = teacher_batch(b=2, t=20)
    head = target.lm_head.weight.detach()[draft_ids()]
    mask = torch.ones_like(ids, dtype=torch.uint8)
    mask[1, :6] = 0
    m = tiny_drafter()
    with torch.no_grad():
        r = ttt_loss(m, head, ids, aux, final, mask, steps=3, chain=True)
        cache, hidden, z = TTTCache("sdpa"), m.project_aux(aux), final @ head.T
        preds, golds, counts = [], [], []
        for k in range(3):
            tokens, positions, counted = step_inputs(ids, mask, k)
            hidden = m.step_hidden(tokens, hidden, positions, cache)
            preds.append(m.logits(hidden).argmax(-1))
            golds.append(shift_left(z.argmax(-1), 1 + k))
            counts.append(counted)
    prior_right = torch.ones_like(counts[0])
    prior_counted = torch.ones_like(counts[0])
    for k in range(3):
        hit = preds[k] == golds[k]
        before = prior_right & prior_counted & counts[k]
        assert r.chain[0, k] == (before & hit).sum() and r.chain[1, k] == before.sum()
        both = counts[k] & counts[0]
        assert r.chain[2, k] == (preds[k] == preds[0])[both].sum() and r.chain[3, k] == both.sum()
        prior_right, prior_counted = prior_right & hit, prior_counted & counts[k]
    assert r.chain[1, 0] == r.step_count[0] and r.chain[2, 0] == r.step_count[0]


def test_teacher_temperature_teaches_the_sharpened_target():
    """temperature T: every step's loss and gradients equal autograd KL against softmax(z / T); the
    accuracy (argmax agreement) is T's to leave alone; a T near 0 is cross-entropy on the target's argmax."""
    from eagle3.drafter.caches import TTTCache

    target, ids, aux, final, _ = teacher_batch(b=2, t=20)
    head = target.lm_head.weight.detach()[draft_ids()]
    mask = torch.ones_like(ids, dtype=torch.uint8)
    m = tiny_drafter()
    params = [p for p in m.parameters() if p.requires_grad]
    r = ttt_loss(m, head, ids, aux, final, mask, steps=3, decay=0.8, chunk_rows=6, temperature=0.25)
    ours = torch.autograd.grad(r.loss, params)
    cache, hidden, total, z = TTTCache("sdpa"), m.project_aux(aux), 0.0, final @ head.T
    for k in range(3):
        tokens, positions, counted = step_inputs(ids, mask, k)
        hidden = m.step_hidden(tokens, hidden, positions, cache)
        p = F.softmax(shift_left(z, 1 + k) / 0.25, -1)
        kl = (p * (p.clamp_min(1e-30).log() - F.log_softmax(m.logits(hidden), -1))).sum(-1)[counted].mean()
        torch.testing.assert_close(r.step_loss[k], kl.detach(), rtol=1e-4, atol=1e-6)
        total = total + 0.8**k * kl
    for a, b in zip(ours, torch.autograd.grad(total, params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    plain = ttt_loss(m, head, ids, aux, final, mask, steps=3, chunk_rows=6)
    torch.testing.assert_close(r.step_acc, plain.step_acc)
    assert not torch.allclose(r.step_loss, plain.step_loss)
    # T -> 0: the KL is the cross-entropy of the draft against the target's argmax (the teacher's entropy -> 0)
    cold = ttt_loss(m, head, ids, aux, final, mask, steps=1, temperature=1e-4)
    with torch.no_grad():
        tokens, positions, counted = step_inputs(ids, mask, 0)
        q = m.logits(m.step_hidden(tokens, m.project_aux(aux), positions, TTTCache("sdpa")))
        ce = F.cross_entropy(q[counted], shift_left(z, 1).argmax(-1)[counted])
    torch.testing.assert_close(cold.step_loss[0], ce, rtol=1e-4, atol=1e-5)


def test_teacher_temperature_must_be_positive():
    import pytest
    from pydantic import ValidationError

    from eagle3.settings.train import TrainSettings

    assert TrainSettings(teacher_temperature=0.25).teacher_temperature == 0.25
    for bad in (0, -1):
        with pytest.raises(ValidationError, match="teacher_temperature"):
            TrainSettings(teacher_temperature=bad)


def test_feature_noise_is_uniform_at_each_aux_layers_own_scale_and_leaves_padding_and_input_alone():
    import pytest

    from eagle3.drafter.loss import noised_features

    torch.manual_seed(0)
    layers = torch.randn(4, 512, 3, 64) * torch.tensor([1e3, 1.0, 1e-3]).view(3, 1)  # scales 6 orders apart
    layers[1, :7] = 0  # padding rows
    aux = layers.flatten(-2)
    kept = aux.clone()
    noised = noised_features(aux, 64, 0.2)
    assert torch.equal(aux, kept)  # the batch is not written: held-out metrics and retries read it again
    assert noised.shape == aux.shape and noised.dtype == aux.dtype
    assert torch.equal(noised.unflatten(-1, (3, 64))[1, :7], torch.zeros(7, 3, 64))
    rms = layers.square().mean(-1, keepdim=True).sqrt()
    rel = (noised.unflatten(-1, (3, 64)) - layers) / rms.clamp_min(1e-30)
    live = rms.squeeze(-1) > 0
    for layer in range(3):  # U(-0.2, 0.2) relative to each layer's own rms: bounded, centred, std 0.2 / sqrt(3)
        r = rel[..., layer, :][live[..., layer]]
        assert r.abs().max() <= 0.2 + 1e-5 and r.abs().max() > 0.199
        assert abs(r.mean().item()) < 2e-3 and abs(r.std().item() - 0.2 / 3**0.5) < 2e-3
    half = noised_features(aux.bfloat16(), 64, 0.2)  # bf16 in, bf16 out (noise made in fp32; bf16 rounds to 2^-8)
    rel = (half.float() - aux.bfloat16().float()) / rms.expand(-1, -1, -1, 64).flatten(-2).clamp_min(1e-30)
    assert half.dtype == torch.bfloat16 and 0.19 < rel[aux != 0].abs().max() < 0.2 + 0.03
    with pytest.raises(ValueError, match="not a multiple"):
        noised_features(aux[..., :100], 64, 0.2)


def test_feature_noise_trains_on_noised_features_and_measures_held_out_on_clean_ones():
    """In training mode the objective sees noised aux hidden states (its loss and gradients change, and vary
    from call to call); in eval mode (held-out metrics) it is exactly the noise-free objective; 0 is off."""
    from eagle3.drafter.loss import TTTObjective

    target, ids, aux, final, _ = teacher_batch(b=2, t=20)
    head = target.lm_head.weight.detach()[draft_ids()]
    mask = torch.ones_like(ids, dtype=torch.uint8)
    m = tiny_drafter()
    plain, noisy = TTTObjective(m, 3, 0.8), TTTObjective(m, 3, 0.8, feature_noise=0.5)
    plain.teacher_head = noisy.teacher_head = head
    plain.eval(), noisy.eval()
    with torch.no_grad():
        torch.testing.assert_close(noisy(ids, aux, final, mask)[1], plain(ids, aux, final, mask)[1], rtol=0, atol=0)
    plain.train(), noisy.train()
    base = plain(ids, aux, final, mask)[1].detach()
    off = TTTObjective(m, 3, 0.8, feature_noise=0.0).train()
    off.teacher_head = head
    torch.testing.assert_close(off(ids, aux, final, mask)[1].detach(), base, rtol=0, atol=0)
    first, second = noisy(ids, aux, final, mask), noisy(ids, aux, final, mask)
    assert not torch.allclose(first[1], base) and not torch.allclose(first[1], second[1])
    grad = torch.autograd.grad(first[0], m.fc.weight)[0]
    assert torch.isfinite(grad).all() and not torch.allclose(grad, torch.autograd.grad(plain(ids, aux, final, mask)[0],
                                                                                        m.fc.weight)[0])


def test_feature_noise_is_a_train_setting_the_stage_hands_to_its_objective(tmp_path):
    import pytest
    from pydantic import ValidationError

    from eagle3.train.distributed import DistEnv
    from eagle3.train.loop import TrainJob, _build
    from eagle3.settings.train import TrainSettings

    with pytest.raises(ValidationError, match="feature_noise"):
        TrainSettings(feature_noise=-0.1)
    target, *_ = teacher_batch()
    job = TrainJob(tiny_drafter().config, target.model.embed_tokens.weight.detach(),
                   target.lm_head.weight.detach()[draft_ids()], plan=None, open_shard=None,  # type: ignore[arg-type]
                   settings=TrainSettings(feature_noise=0.3, compile=False), store=None,  # type: ignore[arg-type]
                   stage_prefix="", output=None, scratch=tmp_path)
    _, objective = _build(job, DistEnv())
    assert objective.feature_noise == 0.3 and TrainSettings().feature_noise == 0.0
