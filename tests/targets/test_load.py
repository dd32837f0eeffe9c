"""Target resolution and the vocab checks generate relies on."""

from __future__ import annotations

import pytest

from eagle3.errors import StageError
from eagle3.targets.load import (
    check_vocab, load_target_config, load_target_model, load_tokenizer, num_layers, resolve_target,
    served_model_name, target_vocab_size,
)
from eagle3.settings.target import TargetSettings
from eagle3.targets.tiny import RECIPE_VERSION


def test_builtin_resolves_to_cached_dir(tiny_cache_dir):
    s = TargetSettings(model="builtin:tiny-deepseek", cache_dir=str(tiny_cache_dir))
    path = resolve_target(s)
    assert path.startswith(str(tiny_cache_dir.resolve())) and path.endswith(f"r{RECIPE_VERSION}")
    assert served_model_name(s) == path
    assert num_layers(load_target_config(s)) == 6


def test_unknown_builtin():
    with pytest.raises(StageError, match="unknown builtin target 'builtin:nope'"):
        resolve_target(TargetSettings(model="builtin:nope"))


def test_local_dir_and_served_name(tiny_llama_dir):
    s = TargetSettings(model=str(tiny_llama_dir))
    assert resolve_target(s) == str(tiny_llama_dir.resolve())
    assert served_model_name(s.model_copy(update={"served_name": "kimi"})) == "kimi"
    cfg, tok = load_target_config(s), load_tokenizer(s)
    assert check_vocab(s, tok, cfg) == target_vocab_size(cfg) == 1024
    model = load_target_model(s, "cpu")
    assert next(model.parameters()).dtype.is_floating_point and not model.training


def test_configured_vocab_mismatch(tiny_llama_dir):
    s = TargetSettings(model=str(tiny_llama_dir), vocab_size=163840)
    with pytest.raises(StageError, match="target.vocab_size is 163840 but the target config .* has vocab_size 1024"):
        check_vocab(s, load_tokenizer(s), load_target_config(s))


def test_tokenizer_larger_than_target_vocab(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.add_tokens([f"<extra_{i}>" for i in range(100)])
    tok.save_pretrained(tmp_path / "big-tok")
    s = TargetSettings(model=str(tiny_llama_dir), tokenizer=str(tmp_path / "big-tok"))
    with pytest.raises(StageError, match=r"tokenizer .*big-tok has 1102 tokens but target vocab_size is 1024"):
        check_vocab(s, load_tokenizer(s), load_target_config(s))


def test_missing_model_is_one_line(tmp_path):
    s = TargetSettings(model=str(tmp_path / "nowhere"))
    with pytest.raises(StageError, match="cannot load target config from") as e:
        load_target_config(s)
    assert "\n" not in str(e.value)
