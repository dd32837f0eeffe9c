import pytest
import torch

from eagle3.drafter.adapter import EXPORT_KEYS, expected_shapes, exportable_state_dict
from eagle3.drafter.loss import step_inputs
from eagle3.drafter.caches import KVCache, TTTCache
from eagle3.drafter.masks import ttt_mask
from eagle3.drafter.model import DrafterConfig
from eagle3.settings.drafter import DrafterSettings
from eagle3.errors import ConfigError
from tests.drafter.helpers import HIDDEN, tiny_config, tiny_drafter


def test_shapes_dtypes_and_export_names():
    m = tiny_drafter()
    ids = torch.randint(0, 120, (2, 5))
    hidden = m.project_aux(torch.randn(2, 5, 3 * HIDDEN))
    out, logits, cache = m.step(ids, hidden, torch.arange(5).expand(2, 5))
    assert out.shape == (2, 5, HIDDEN) and logits.shape == (2, 5, 60)
    assert out.dtype == logits.dtype == torch.float32 and isinstance(cache, KVCache) and cache.length == 5
    sd = exportable_state_dict(m)
    assert list(sd) == list(EXPORT_KEYS)
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected_shapes(m.config)
    assert m.midlayer.self_attn.q_proj.weight.shape == (4 * 8, 2 * HIDDEN)  # q/k/v take 2h
    assert not m.embed_tokens.weight.requires_grad


def test_ttt_mask_blocks():
    m = ttt_mask(3, 2)
    assert m.shape == (3, 9)
    assert m[:, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert m[:, 3:6].equal(torch.eye(3, dtype=torch.bool)) and m[:, 6:].equal(torch.eye(3, dtype=torch.bool))


def _ttt_logits(m, ids, aux, steps, backend="sdpa"):
    cache, hidden, out = TTTCache(backend), m.project_aux(aux), []
    for k in range(steps):
        tokens, positions, _ = step_inputs(ids, torch.ones_like(ids), k)
        hidden, logits, _ = m.step(tokens, hidden, positions, cache)
        out.append(logits)
    return out


@torch.no_grad()
def test_ttt_unroll_equals_token_by_token_drafting():
    """Row t at TTT step k sees exactly what decoding sees: prefill rows <= t, then its own outputs."""
    m = tiny_drafter()
    b, t, steps = 2, 10, 4
    ids, aux = torch.randint(0, 120, (b, t)), torch.randn(b, t, 3 * HIDDEN)
    ttt = _ttt_logits(m, ids, aux, steps)
    for row in (0, 3, 5):
        cache = KVCache()
        tokens = ids[:, 1 : row + 2]  # x_{1..row+1}
        hidden, logits, cache = m.step(tokens, m.project_aux(aux[:, : row + 1]), torch.arange(row + 1).expand(b, -1), cache)
        torch.testing.assert_close(logits[:, row], ttt[0][:, row], rtol=1e-4, atol=1e-5)
        for k in range(1, steps):
            tok = ids[:, row + 1 + k : row + 2 + k]
            hidden, logits, cache = m.step(tok, hidden[:, -1:], torch.full((b, 1), row + k), cache)
            torch.testing.assert_close(logits[:, 0], ttt[k][:, row], rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_flex_attention_matches_dense_mask():
    m = tiny_drafter()
    ids, aux = torch.randint(0, 120, (2, 9)), torch.randn(2, 9, 3 * HIDDEN)
    for a, b in zip(_ttt_logits(m, ids, aux, 3, "sdpa"), _ttt_logits(m, ids, aux, 3, "flex")):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_config_from_target_and_round_trip():
    target = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 500}
    cfg = DrafterConfig.from_target(target, DrafterSettings(), 100, [1, 2, 3])
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.intermediate_size) == (64, 16, 2, 96)
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="hidden_size"):
        DrafterConfig.from_target(target, DrafterSettings(hidden_size=32), 100, [1, 2, 3])
    with pytest.raises(ConfigError, match="lacks"):
        DrafterConfig.from_dict({"hidden_size": 3})
    assert tiny_config().to_dict()["aux_layer_ids"] == [1, 2, 3]
