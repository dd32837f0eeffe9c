"""Aux layer ids: defaults, and SGLang's per-family rule (0.5.23) against vLLM's convention."""

from __future__ import annotations

import itertools

import pytest

from eagle3.targets.aux_layers import (DEEPSEEK_STYLE, FINAL_SLOT, LLAMA_STYLE, default_aux_layer_ids,
                                       sglang_captures, target_family, to_sglang, vllm_captures_final,
                                       vllm_extract_ids)
from eagle3.targets.load import JsonConfig


def test_defaults():
    assert default_aux_layer_ids(61) == [2, 30, 58]  # Kimi-K2.5
    assert default_aux_layer_ids(32) == [2, 16, 29]
    assert [default_aux_layer_ids(n) for n in (4, 5, 6, 7)] == [[1, 2, 3], [2, 3, 4], [2, 3, 5], [2, 3, 4]]
    with pytest.raises(ValueError, match="at least 4"):
        default_aux_layer_ids(3)


@pytest.mark.parametrize("layers", [5, 6, 7, 8, 16, 61])
def test_default_ids_are_servable_by_sglang_for_every_family(layers):
    ids = default_aux_layer_ids(layers)
    for family in (LLAMA_STYLE, DEEPSEEK_STYLE):
        assert sglang_captures(to_sglang(ids, family), family) == ids


def test_sglang_rule_per_family():
    # Llama (srt/models/llama.py): adds 1 always.
    assert sglang_captures([1, 29, 57], LLAMA_STYLE) == [2, 30, 58] and to_sglang([2, 30, 58], LLAMA_STYLE) == [1, 29, 57]
    # DeepseekV2/V3 and KimiK25 (deepseek_v2.py): adds 1 only when the first id is 1.
    assert sglang_captures([1, 29, 57], DEEPSEEK_STYLE) == [2, 30, 58]
    assert sglang_captures([2, 30, 58], DEEPSEEK_STYLE) == [2, 30, 58]
    assert sglang_captures([2, 29, 57], DEEPSEEK_STYLE) == [2, 29, 57]  # vLLM ids [3, 30, 58] minus 1: one layer shallow
    assert to_sglang([2, 30, 58], DEEPSEEK_STYLE) == [2, 30, 58] and to_sglang([3, 30, 58], DEEPSEEK_STYLE) == [3, 30, 58]
    assert to_sglang([3, 4, 5], DEEPSEEK_STYLE) == [3, 4, 5]  # the tiny Kimi target with aux ids [3, 4, 5]
    with pytest.raises(ValueError, match=r"\[1, 3, 5\] start at 1, which SGLang cannot express for a DeepseekV2"):
        to_sglang([1, 3, 5], DEEPSEEK_STYLE)
    with pytest.raises(ValueError, match="known for the families Llama .*DeepseekV2"):
        to_sglang([2, 3, 5], None)


def test_every_expressible_id_list_round_trips():
    for ids in itertools.combinations(range(8), 3):
        ids = list(ids)
        assert sglang_captures(to_sglang(ids, LLAMA_STYLE), LLAMA_STYLE) == ids
        if ids[0] == 1:
            with pytest.raises(ValueError):
                to_sglang(ids, DEEPSEEK_STYLE)
        else:
            assert sglang_captures(to_sglang(ids, DEEPSEEK_STYLE), DEEPSEEK_STYLE) == ids


def test_families_of_targets():
    assert target_family(JsonConfig(model_type="llama")) is LLAMA_STYLE
    assert target_family(JsonConfig(model_type="qwen3")) is LLAMA_STYLE
    assert target_family(JsonConfig(model_type="deepseek_v3")) is DEEPSEEK_STYLE
    kimi = JsonConfig(model_type="kimi_k25", architectures=["KimiK25ForConditionalGeneration"],
                      text_config={"model_type": "deepseek_v3"})
    assert target_family(kimi) is DEEPSEEK_STYLE
    assert target_family(JsonConfig(model_type="gpt_oss")) is None


def test_tiny_targets_families(tiny_target_dir):
    from eagle3.targets.load import load_target_config
    from eagle3.settings.target import TargetSettings

    got = {a: target_family(load_target_config(TargetSettings(model=str(tiny_target_dir(a))))).name
           for a in ("llama", "deepseek", "kimi")}
    assert got == {"llama": "Llama", "deepseek": "DeepseekV2", "kimi": "DeepseekV2"}


def test_vllm_final_id_by_release():
    assert [vllm_captures_final(LLAMA_STYLE, v) for v in ((0, 22, 1), (0, 34, 0))] == [True, True]
    assert [vllm_captures_final(DEEPSEEK_STYLE, v) for v in ((0, 22, 1), (0, 24, 0), (0, 25, 0), (0, 26, 0))] == \
        [False, False, True, True]
    assert vllm_extract_ids([2, 30, 58], 61, True) == [2, 30, 58, 61]
    assert vllm_extract_ids([2, 30, 58], 61, False) == [2, 30, 58, FINAL_SLOT]
