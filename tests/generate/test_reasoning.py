"""Reasoning capture: a separate field, or inline think tags."""

from __future__ import annotations

from eagle3.generate.reasoning import split_inline, split_reasoning


def test_reasoning_content_field():
    s = split_reasoning({"content": "\n\nAnswer", "reasoning_content": "\nthinking\n"})
    assert (s.content, s.reasoning, s.source) == ("Answer", "thinking", "field")


def test_reasoning_field_newer_vllm():
    s = split_reasoning({"content": "A", "reasoning": "r"})
    assert (s.content, s.reasoning, s.source) == ("A", "r", "field")


def test_inline_think_tags():
    s = split_reasoning({"content": "<think>\nstep 1\n</think>\n\nThe answer."})
    assert (s.content, s.reasoning, s.source) == ("The answer.", "step 1", "inline")


def test_generation_prompt_opened_the_think_block():
    s = split_inline("step 1</think>done")
    assert (s.content, s.reasoning, s.source) == ("done", "step 1", "inline")


def test_cut_inside_the_think_block():
    s = split_inline("<think>still thinking")
    assert (s.content, s.reasoning, s.source) == ("", "still thinking", "unterminated")


def test_no_reasoning():
    s = split_reasoning({"content": "plain", "reasoning_content": None})
    assert (s.content, s.reasoning, s.source, s.has_reasoning) == ("plain", None, "none", False)


def test_think_tags_inside_an_answer_are_not_reasoning():
    s = split_inline("Use <think> like this: <think>x</think>")
    assert s.reasoning is None and s.content == "Use <think> like this: <think>x</think>"


def test_empty_think_block():
    s = split_inline("<think>\n\n</think>\n\nHi")
    assert (s.content, s.reasoning) == ("Hi", None)
