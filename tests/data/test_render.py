"""Loss masks: the assistant turn, rendered through the target tokenizer's own chat template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from eagle3.data.render import render_sample
from eagle3.errors import StageError

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 2?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_mask_covers_exactly_the_assistant_turn(tokenizer):
    ids, mask, inlined = render_sample(tokenizer, PROMPT, "4.", "add two and two")
    head = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    n_head = len(tokenizer(head, add_special_tokens=False)["input_ids"])
    assert mask == [0] * n_head + [1] * (len(ids) - n_head)
    assert tokenizer.decode(ids[n_head:]) == "<think>\nadd two and two\n</think>\n4.<|im_end|>\n"
    assert not inlined


def test_no_reasoning(tokenizer):
    ids, mask, _ = render_sample(tokenizer, PROMPT, "4.", None)
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "4.<|im_end|>\n"


def test_template_without_reasoning_support_gets_inline_think(tokenizer):
    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    # A template that ignores reasoning_content (like many non-reasoning models' templates).
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ids, mask, inlined = render_sample(tok, PROMPT, "4.", "hmm")
    assert inlined
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "<think>\nhmm\n</think>\n\n4.<|im_end|>\n"


def test_template_breaking_the_prefix_property(tokenizer):
    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    # Renders the generation prompt differently from the assistant turn's header.
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(StageError, match="breaks the prefix property"):
        render_sample(tok, PROMPT, "4.", None)


def test_template_error_is_one_line(tokenizer):
    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(StageError, match="chat template of the target tokenizer failed: .*no system role"):
        render_sample(tok, PROMPT, "4.", None)
