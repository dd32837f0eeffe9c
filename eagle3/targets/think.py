"""Think tags: how a reasoning target's chat template marks its reasoning.

The tags are ``<think>…</think>``. Templates that open the think block in the generation
prompt (Kimi-K2.5, Qwen3-thinking) make the response start inside it.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def opens_think_block(prompt: str) -> bool:
    """The generation prompt leaves a think block open (Kimi-K2.5, Qwen3-thinking): the
    response starts inside the reasoning and only closes it."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)
