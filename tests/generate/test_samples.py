"""Validation, exclusion by reason, and token frequencies over loss-masked tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from eagle3.generate.client import ChatOutcome
from eagle3.generate.prompts import Prompt
from eagle3.generate.samples import build_samples, merge_records, outcome_record, token_frequencies

USER = [{"role": "user", "content": "hi"}]


def _ok(sid, content, reasoning_content=None, finish="stop"):
    msg = {"role": "assistant", "content": content}
    if reasoning_content is not None:
        msg["reasoning_content"] = reasoning_content
    body = {"choices": [{"message": msg, "finish_reason": finish}], "usage": {"completion_tokens": 3}}
    return outcome_record(Prompt(sid, USER), ChatOutcome(sid, body))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_exclusions_are_counted_by_reason(tokenizer):
    records = [
        _ok(0, "fine answer"),
        _ok(1, "<think>why</think>answer"),
        _ok(2, "   "),
        outcome_record(Prompt(3, USER), ChatOutcome(3, None, "HTTP 400: bad", 1)),
        _ok(4, "word " * 200),
        _ok(5, "x", reasoning_content="r"),
    ]
    data, stats = build_samples(records, tokenizer, max_length=64, drop_truncated=True, require_reasoning=False)
    s = stats.as_dict()
    assert data.sample_ids.tolist() == [0, 1, 5]
    assert s["excluded"] == {"empty": 1, "request_failed": 1, "too_long": 1}
    assert (s["requested"], s["succeeded"], s["failed"], s["kept"]) == (6, 5, 1, 3)
    assert s["reasoning_captured"] == 2 and s["reasoning_capture_rate"] == 0.4
    assert [r["excluded"] for r in records] == [None, None, "empty", "request_failed", "too_long", None]
    assert data.validate(vocab_size=1024) == []


def test_require_reasoning_and_cut_instead_of_drop(tokenizer):
    records = [_ok(0, "no reasoning"), _ok(1, "word " * 200, reasoning_content="r")]
    data, stats = build_samples(records, tokenizer, max_length=64, drop_truncated=False, require_reasoning=True)
    assert stats.excluded == {"missing_reasoning": 1}
    assert data.sample_ids.tolist() == [1] and data.num_tokens == 64 and stats.truncated_to_max_length == 1


def test_token_frequencies_count_only_assistant_tokens(tokenizer):
    data, _ = build_samples([_ok(0, "a b"), _ok(1, "c")], tokenizer, 512, True, False)
    counts = token_frequencies(data, 1024)
    assert counts.dtype == torch.int64 and counts.shape == (1024,)
    assert int(counts.sum()) == int(data.loss_mask.sum())
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert int(counts[im_start]) == 0  # only in prompts, never in the assistant turn


def test_merge_prefers_success_then_latest():
    fail = {"id": 1, "error": "boom"}
    ok_old, ok_new = {"id": 1, "error": None, "v": 1}, {"id": 1, "error": None, "v": 2}
    assert merge_records([ok_old], [fail])[1] is ok_old
    assert merge_records([fail], [ok_old])[1] is ok_old
    assert merge_records([ok_old], [ok_new])[1] is ok_new


def _kimi_ok(sid, content, reasoning=None, finish="stop", **choice):
    msg = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    body = {"choices": [{"message": msg, "finish_reason": finish, **choice}], "usage": {}}
    return outcome_record(Prompt(sid, USER), ChatOutcome(sid, body))


def test_kimi_samples_are_built_as_generated_and_unfaithful_ones_excluded(tiny_target_dir):
    kimi = AutoTokenizer.from_pretrained(tiny_target_dir("kimi"))
    eot = kimi.convert_tokens_to_ids("<|im_end|>")
    records = [
        _kimi_ok(0, "4.", "think"),  # reasoning parser
        _kimi_ok(1, "", "think"),  # parser, no content, stopped: the close tag is unknowable
        _kimi_ok(2, "4.", "think", token_ids=[7, 8, eot]),  # the server's own tokens
        _kimi_ok(3, "4.", "think", finish="abort"),
    ]
    data, stats = build_samples(records, kimi, max_length=256, drop_truncated=True, require_reasoning=False)
    s = stats.as_dict()
    assert data.sample_ids.tolist() == [0, 2]
    assert s["excluded"] == {"not_finished": 1, "reasoning_end_unknown": 1}
    assert s["response_tokens_from"] == {"server_tokens": 1, "text": 1}
    assert "reasoning_inlined_for_template" not in s
    ids, mask = data.sample(0)
    assert kimi.decode(ids[mask.bool()].tolist()) == "think</think>4.<|im_end|>"
    ids, mask = data.sample(1)
    assert ids[mask.bool()].tolist() == [7, 8, eot]
    assert [r["excluded"] for r in records] == [None, "reasoning_end_unknown", None, "not_finished"]


def test_return_token_ids_is_asked_of_vllm_only():
    from eagle3.config import PipelineConfig
    from eagle3.generate.stage import request_extras

    assert request_extras(PipelineConfig(serve={"engine": "vllm"})) == {"return_token_ids": True}
    assert request_extras(PipelineConfig(serve={"engine": "transformers"})) == {}
    assert request_extras(PipelineConfig(serve={"engine": "transformers"}, generate={"return_token_ids": True})) == {
        "return_token_ids": True}
