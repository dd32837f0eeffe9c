"""Render a prompt and the target's response through the target tokenizer's own chat template.

The loss mask covers the assistant turn: every token after the rendered
prompt-with-generation-prompt. That needs the template's *prefix property*: rendering
the prompt with ``add_generation_prompt=True`` is a prefix of rendering the whole
conversation, as text and as tokens. Templates that break it get one clear error
rather than silently misplaced masks.
"""

from __future__ import annotations

from typing import Any

from eagle3.data.reasoning import THINK_CLOSE, THINK_OPEN
from eagle3.errors import StageError


def inline_reasoning(content: str, reasoning: str) -> str:
    """The think block as the target emits it, for templates that drop ``reasoning_content``."""
    return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{content}"


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja errors carry the template's own message
        raise StageError(f"chat template of the target tokenizer failed: {type(e).__name__}: {e}") from None


def render_sample(tokenizer: Any, prompt: list[dict[str, str]], content: str,
                  reasoning: str | None) -> tuple[list[int], list[int], bool]:
    """(input_ids, loss_mask, reasoning_inlined): mask 1 on the assistant turn's tokens.

    ``reasoning_inlined`` says the template ignored ``reasoning_content`` and the think
    block was put back into the content so the tokens match what the target generated.
    """
    head = _render(tokenizer, prompt, add_generation_prompt=True)
    reply: dict[str, str] = {"role": "assistant", "content": content}
    if reasoning:
        reply["reasoning_content"] = reasoning
    full = _render(tokenizer, [*prompt, reply], add_generation_prompt=False)
    inlined = False
    if reasoning and reasoning not in full[len(head):]:
        full = _render(tokenizer, [*prompt, {"role": "assistant", "content": inline_reasoning(content, reasoning)}],
                       add_generation_prompt=False)
        inlined = True
    if not full.startswith(head):
        raise StageError("chat template of the target tokenizer breaks the prefix property: the prompt rendered with "
                         "add_generation_prompt=True is not a prefix of the rendered conversation")
    head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    if ids[: len(head_ids)] != head_ids:
        raise StageError("chat template of the target tokenizer breaks the prefix property at the token level: "
                         "the prompt's tokens change when the assistant turn follows")
    mask = [0] * len(head_ids) + [1] * (len(ids) - len(head_ids))
    return ids, mask, inlined
