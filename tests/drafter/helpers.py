"""Tiny drafters and real teacher hidden states from a tiny HF Llama built from config."""

from __future__ import annotations

import torch

from eagle3.drafter.model import DrafterConfig, Eagle3Drafter

VOCAB, HIDDEN, DRAFT = 120, 32, 60
AUX = [1, 2, 3]


def tiny_config(**kw) -> DrafterConfig:
    base = dict(hidden_size=HIDDEN, target_hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, draft_vocab_size=DRAFT, aux_layer_ids=AUX)
    return DrafterConfig(**{**base, **kw})


def tiny_drafter(seed: int = 0, **kw) -> Eagle3Drafter:
    torch.manual_seed(seed)
    return Eagle3Drafter(tiny_config(**kw)).eval()


def teacher_batch(b: int = 2, t: int = 16, seed: int = 0):
    """(target, input_ids [B,T], aux [B,T,3H], final [B,T,H]) from a random 4-layer Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    target = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, VOCAB, (b, t))
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    hs = out.hidden_states
    aux = torch.cat([hs[i] for i in AUX], dim=-1)
    return target, ids, aux, hs[-1], out.logits


def draft_ids(n: int = DRAFT, vocab: int = VOCAB) -> torch.Tensor:
    """Target ids of the draft vocab (ascending), a fixed pseudo-random subset."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:n].sort().values
