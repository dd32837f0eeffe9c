"""Reasoning from a chat completion message: a separate field, or inline think tags.

vLLM started with a reasoning parser returns thinking in ``reasoning_content`` (newer
versions: ``reasoning``); without one, the text arrives inline as ``<think>…</think>``
before the answer. Templates that open the think block in the generation prompt make
the response start inside it, so a closing tag with no opening tag is reasoning too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3.targets.think import THINK_CLOSE, THINK_OPEN

REASONING_FIELDS = ("reasoning_content", "reasoning")


@dataclass(frozen=True)
class SplitResponse:
    content: str
    reasoning: str | None  # None: the response carries no reasoning
    source: str  # "field", "inline", "unterminated" (cut inside the think block) or "none"

    @property
    def has_reasoning(self) -> bool:
        return bool(self.reasoning)


def split_inline(text: str) -> SplitResponse:
    """``[<think>]R</think>C`` → (C, R); ``<think>R`` with no close → unterminated reasoning."""
    close = text.find(THINK_CLOSE)
    if close >= 0:
        head = text[:close]
        open_at = head.find(THINK_OPEN)
        if open_at >= 0 and head[:open_at].strip():
            return SplitResponse(text, None, "none")  # think tags in the middle of an answer: not reasoning
        reasoning = head[open_at + len(THINK_OPEN):] if open_at >= 0 else head
        return SplitResponse(text[close + len(THINK_CLOSE):].strip(), reasoning.strip() or None, "inline")
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        return SplitResponse("", stripped[len(THINK_OPEN):].strip() or None, "unterminated")
    return SplitResponse(text, None, "none")


def split_reasoning(message: dict[str, Any]) -> SplitResponse:
    """Content and reasoning of an OpenAI chat ``message`` object."""
    content = message.get("content") or ""
    for name in REASONING_FIELDS:
        value = message.get(name)
        if isinstance(value, str) and value.strip():
            return SplitResponse(content.strip(), value.strip(), "field")
    return split_inline(content)
