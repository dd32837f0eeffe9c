"""Samples as the target produced them: prompt from the generation prompt, response as generated."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from eagle3.generate.render import (
    NOT_FINISHED,
    NOT_REPRODUCIBLE,
    REASONING_END_UNKNOWN,
    THINK_TAGS_NOT_IN_TEXT,
    Generated,
    Unfaithful,
    build_sample,
    end_of_turn_id,
    opens_think_block,
)
from eagle3.errors import StageError

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 2?"}]


@pytest.fixture(scope="module")
def chatml(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def kimi(tiny_target_dir):
    """The tiny Kimi target's tokenizer: tiktoken files, Kimi's special tokens and its template's behaviour."""
    return AutoTokenizer.from_pretrained(tiny_target_dir("kimi"))


def response(tok, sample) -> str:
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m], skip_special_tokens=False)


def test_kimi_template_is_the_one_the_issue_describes(kimi):
    head = kimi.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert head.endswith("<|im_assistant|>assistant<|im_middle|><think>") and opens_think_block(head)
    finished = kimi.apply_chat_template([*PROMPT, {"role": "assistant", "content": "4.", "reasoning_content": "R"}],
                                        tokenize=False)
    # A finished conversation's last turn is history: its reasoning is blanked, and the
    # turn no longer continues the generation prompt the way the target generated it.
    assert finished[len(head):] == "</think>4.<|im_end|>"


@pytest.mark.parametrize("gen", [
    Generated(content="4.", reasoning="add two and two", finish_reason="stop"),  # vLLM reasoning parser
    Generated(content="add two and two</think>4.", reasoning=None, finish_reason="stop"),  # no parser: inline
], ids=["reasoning-field", "inline"])
def test_kimi_response_is_what_the_target_generated(kimi, gen):
    sample = build_sample(kimi, PROMPT, gen)
    head = kimi.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    head_ids = kimi(head, add_special_tokens=False)["input_ids"]
    want = head_ids + kimi("add two and two</think>4.", add_special_tokens=False)["input_ids"] + [
        kimi.convert_tokens_to_ids("<|im_end|>")]
    assert sample.input_ids == want
    assert sample.loss_mask == [0] * len(head_ids) + [1] * (len(want) - len(head_ids))
    assert response(kimi, sample) == "add two and two</think>4.<|im_end|>"
    assert sample.response_from == "text"


def test_end_of_turn_is_the_templates_not_the_eos(kimi, chatml):
    assert kimi.eos_token == "[EOS]"
    assert end_of_turn_id(kimi) == kimi.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_id(chatml) == chatml.convert_tokens_to_ids("<|im_end|>")


def test_chatml_template_without_think_in_the_prompt(chatml):
    gen = Generated(content="<think>\nadd\n</think>\n4.", reasoning=None, finish_reason="stop")
    assert response(chatml, build_sample(chatml, PROMPT, gen)) == "<think>\nadd\n</think>\n4.<|im_end|>"
    field = Generated(content="\n4.", reasoning="\nadd\n", finish_reason="stop")  # raw, never stripped
    assert response(chatml, build_sample(chatml, PROMPT, field)) == "<think>\nadd\n</think>\n4.<|im_end|>"


def test_server_token_ids_are_used_verbatim(kimi):
    ids = [5, 6, 7, kimi.convert_tokens_to_ids("<|im_end|>")]
    sample = build_sample(kimi, PROMPT, Generated(content="ignored", reasoning="ignored", finish_reason="stop",
                                                  token_ids=ids))
    assert sample.input_ids[-4:] == ids and sample.loss_mask[-5:] == [0, 1, 1, 1, 1]
    assert sample.response_from == "server_tokens" and not sample.prompt_differs


def test_server_prompt_tokens_win_and_a_difference_is_flagged(kimi):
    sample = build_sample(kimi, PROMPT, Generated("4.", "r", "stop", token_ids=[9], prompt_token_ids=[1, 2, 3]))
    assert sample.input_ids == [1, 2, 3, 9] and sample.loss_mask == [0, 0, 0, 1] and sample.prompt_differs


def test_cut_inside_the_reasoning_has_no_close_and_no_end_of_turn(kimi):
    sample = build_sample(kimi, PROMPT, Generated(content="", reasoning="still thinking", finish_reason="length"))
    assert response(kimi, sample) == "still thinking"


def test_stop_reason_token_ends_the_response(kimi):
    stop = kimi.convert_tokens_to_ids("[EOT]")
    sample = build_sample(kimi, PROMPT, Generated("4.", "r", "stop", stop_reason=stop))
    assert sample.input_ids[-1] == stop


@pytest.mark.parametrize("gen,reason", [
    # A parser's reasoning with no content after a stop: was </think> emitted before the end?
    (Generated(content="", reasoning="r", finish_reason="stop"), REASONING_END_UNKNOWN),
    (Generated(content="4.", reasoning="r", finish_reason="abort"), NOT_FINISHED),
    (Generated(content="4.", reasoning="r", finish_reason=None), NOT_FINISHED),
])
def test_unfaithful_samples_are_refused_with_a_reason(kimi, gen, reason):
    with pytest.raises(Unfaithful) as e:
        build_sample(kimi, PROMPT, gen)
    assert e.value.reason == reason


def test_skipped_special_think_tags_are_refused(kimi):
    gen = Generated(content="add two4.", reasoning=None, finish_reason="stop")  # the </think> vanished
    with pytest.raises(Unfaithful) as e:
        build_sample(kimi, PROMPT, gen, tags_special=True)
    assert e.value.reason == THINK_TAGS_NOT_IN_TEXT
    # With plain think tags the text is what the target generated, closing tag or not.
    assert response(kimi, build_sample(kimi, PROMPT, gen, tags_special=False)) == "add two4.<|im_end|>"


def test_text_that_does_not_tokenize_back_is_refused(kimi, monkeypatch):
    monkeypatch.setattr(type(kimi), "decode", lambda self, ids, **kw: "something else")
    with pytest.raises(Unfaithful) as e:
        build_sample(kimi, PROMPT, Generated("4.", "r", "stop"))
    assert e.value.reason == NOT_REPRODUCIBLE


def test_template_error_is_one_line(chatml):
    tok = AutoTokenizer.from_pretrained(chatml.name_or_path)
    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(StageError, match="chat template of the target tokenizer failed: .*no system role"):
        build_sample(tok, PROMPT, Generated("4.", None, "stop"))
