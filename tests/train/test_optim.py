"""train.optimizer: Muon over the drafter's matrices, AdamW over the rest, one schedule, one checkpoint."""

from __future__ import annotations

import pytest
import torch

from eagle3.drafter.loss import TTTObjective
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.errors import StageError
from eagle3.train.optim import Optimizers
from eagle3.train.schedule import lr_factor
from eagle3.settings.train import TrainSettings


def objective() -> TTTObjective:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, target_hidden_size=32, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=96, draft_vocab_size=48, aux_layer_ids=[0, 1, 2])
    drafter = Eagle3Drafter(cfg)
    drafter.embed_tokens.weight.requires_grad_(False)
    return TTTObjective(drafter, 3, 0.8)


def optimizers(obj: torch.nn.Module, **settings) -> Optimizers:
    s = TrainSettings(lr=1e-3, warmup_steps=2, **settings)
    return Optimizers(obj, s, lambda st: lr_factor(st, s.warmup_steps, 10, s.min_lr_ratio), fused=False)


def test_muon_takes_the_layer_matrices_and_adamw_the_head_and_norms():
    obj = objective()
    opts = optimizers(obj, optimizer="muon")
    muon, adamw = opts.all
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in obj.named_parameters()}
    on_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    on_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    trained = {n for n, p in obj.named_parameters() if p.requires_grad}
    assert on_muon | on_adamw == trained and not on_muon & on_adamw
    assert "drafter.fc.weight" in on_muon and "drafter.lm_head.weight" in on_adamw
    assert all(p.ndim == 2 for g in muon.param_groups for p in g["params"])
    assert any("norm" in n for n in on_adamw) and not any("norm" in n for n in on_muon)
    assert "drafter.embed_tokens.weight" not in trained  # frozen: on neither
    assert muon.param_groups[0]["weight_decay"] == 0.1 and adamw.param_groups[0]["weight_decay"] == 0.0


def test_both_optimizers_follow_one_schedule():
    obj = objective()
    opts = optimizers(obj, optimizer="muon")
    seen = []
    for _ in range(4):
        for p in obj.parameters():
            if p.requires_grad:
                p.grad = torch.randn_like(p)
        seen.append([g["lr"] for o in opts.all for g in o.param_groups])
        opts.step()
    assert [lrs[0] for lrs in seen] == pytest.approx([1e-3 * lr_factor(st, 2, 10, 0.1) for st in range(4)])
    assert all(len(set(lrs)) == 1 for lrs in seen)


def test_a_checkpoint_of_one_layout_does_not_load_into_the_other():
    obj = objective()
    adamw = optimizers(obj)
    muon = optimizers(obj, optimizer="muon")
    for p in obj.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    adamw.step()
    with pytest.raises(StageError, match="written with another train.optimizer"):
        muon.load_state_dict(obj, adamw.state_dict(obj))


def test_adamw_checkpoints_keep_the_layout_they_had_before_muon():
    obj = objective()
    sd = optimizers(obj).state_dict(obj)
    assert isinstance(sd["scheduler"], dict) and set(sd) == {"optimizer", "scheduler"}


def test_unknown_optimizer_is_rejected_at_config_load():
    from eagle3.config import load_config

    with pytest.raises(Exception, match="optimizer"):
        load_config(None, {"train.optimizer": "sgd"})


def test_vectors_stored_as_matrices_and_embeddings_stay_on_adamw():
    from eagle3.train.optim import muon_matrix

    assert muon_matrix("drafter.fc.weight", torch.zeros(4, 12))
    assert not muon_matrix("drafter.gate.weight", torch.zeros(1, 12))
    assert not muon_matrix("drafter.embed_tokens.weight", torch.zeros(96, 32))
    assert not muon_matrix("drafter.lm_head.weight", torch.zeros(48, 32))
    assert not muon_matrix("drafter.norm.weight", torch.zeros(32))


def test_the_adamw_group_under_muon_follows_the_schedule_from_its_own_peak():
    """train.adamw_lr: the draft head and the norms at their own peak lr beside Muon's, warmed up and decayed by the
    same schedule; unset, both start from lr; with optimizer adamw it changes nothing."""
    obj = objective()
    opts = optimizers(obj, optimizer="muon", adamw_lr=2.5e-4)
    seen = []
    for _ in range(4):
        for p in obj.parameters():
            if p.requires_grad:
                p.grad = torch.randn_like(p)
        seen.append([o.param_groups[0]["lr"] for o in opts.all])
        opts.step()
    factors = [lr_factor(st, 2, 10, 0.1) for st in range(4)]
    assert [m for m, _ in seen] == pytest.approx([1e-3 * f for f in factors])
    assert [a for _, a in seen] == pytest.approx([2.5e-4 * f for f in factors])
    assert opts.lr == pytest.approx(1e-3 * lr_factor(4, 2, 10, 0.1))
    adamw_only = optimizers(objective(), optimizer="adamw", adamw_lr=2.5e-4)
    assert [g["initial_lr"] for o in adamw_only.all for g in o.param_groups] == [1e-3]
    with pytest.raises(ValueError, match="adamw_lr"):
        TrainSettings(optimizer="muon", adamw_lr=0)
