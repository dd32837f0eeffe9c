"""Build a training sample as the target produced it: the prompt it saw, the tokens it generated.

The sample is ``prompt tokens + response tokens`` with the loss mask on the response:

- prompt tokens: the target tokenizer's chat template rendered with
  ``add_generation_prompt=True`` (what a server feeds the target), or the server's own
  ``prompt_token_ids`` when it returned them;
- response tokens: the server's ``token_ids`` when it returned them (vLLM with
  ``return_token_ids``), else the generated text rebuilt from the response fields and
  tokenized on its own, then the end-of-turn token the target stopped on.

The response is never re-rendered through the template's assistant branch: templates
like Kimi-K2.5's open ``<think>`` in the generation prompt and blank the reasoning of
historical assistant turns (a finished conversation's last turn is one), so rendering
the whole conversation yields a context the served target never sees. A response that
cannot be rebuilt exactly raises :class:`Unfaithful` with the reason it is excluded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3.errors import StageError
from eagle3.targets.think import THINK_CLOSE, THINK_OPEN, opens_think_block

# Exclusion reasons (keys of the metadata's ``excluded`` counts).
REASONING_END_UNKNOWN = "reasoning_end_unknown"  # reasoning field, no content, stopped: was </think> emitted?
THINK_TAGS_NOT_IN_TEXT = "think_tags_not_in_text"  # the server's text dropped special think tags
NOT_REPRODUCIBLE = "response_not_reproducible"  # the text does not tokenize back to itself
NOT_FINISHED = "not_finished"  # finish reason other than stop/length (abort, error, ...)

_SENTINEL = "\x00eagle3-end-of-turn-probe\x00"


class Unfaithful(Exception):
    """The response cannot be turned into the tokens the target generated; ``reason`` is counted."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Generated:
    """One response as the endpoint reported it (raw strings, never stripped)."""

    content: str
    reasoning: str | None  # from a separate field (reasoning parser); None when the text carries it inline
    finish_reason: str | None
    token_ids: list[int] | None = None  # the response's own tokens (vLLM ``return_token_ids``)
    prompt_token_ids: list[int] | None = None
    stop_reason: int | str | None = None  # vLLM: the stop token id that ended the response, if not EOS


@dataclass(frozen=True)
class Sample:
    input_ids: list[int]
    loss_mask: list[int]
    response_from: str  # "server_tokens" or "text"
    prompt_differs: bool  # the server's prompt tokens differ from the local render (the server's are used)


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja errors carry the template's own message
        raise StageError(f"chat template of the target tokenizer failed: {type(e).__name__}: {e}") from None


def generation_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The prompt text a server feeds the target: the template with its generation prompt."""
    return _render(tokenizer, messages, add_generation_prompt=True)


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The token the template writes right after an assistant message: what the target
    emits to end its turn (``<|im_end|>`` for ChatML and Kimi); else the tokenizer's EOS."""
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:
        text = ""
    at = text.find(_SENTINEL)
    tail = text[at + len(_SENTINEL):] if at >= 0 else ""
    ids = encode(tokenizer, tail) if tail else []
    added = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}  # <|im_end|> is no named special
    if ids and ids[0] in added | set(tokenizer.all_special_ids):
        return int(ids[0])
    return None if tokenizer.eos_token_id is None else int(tokenizer.eos_token_id)


def think_tags_are_special(tokenizer: Any) -> bool:
    """Servers detokenize with ``skip_special_tokens``: special think tags vanish from the text."""
    special = set(tokenizer.all_special_ids)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in (THINK_OPEN, THINK_CLOSE)]
    return any(i is not None and i in special for i in ids)


def response_text(prompt: str, gen: Generated, tags_special: bool) -> str:
    """The text the target generated after ``prompt`` (without the end-of-turn token)."""
    opened = opens_think_block(prompt)
    if gen.reasoning is not None:  # a reasoning parser split the text: put its tags back where they were
        start = "" if opened else THINK_OPEN
        if gen.content:
            return start + gen.reasoning + THINK_CLOSE + gen.content
        if gen.finish_reason == "length":
            return start + gen.reasoning  # cut inside the think block
        raise Unfaithful(REASONING_END_UNKNOWN)
    if opened and tags_special and THINK_CLOSE not in gen.content and gen.finish_reason == "stop":
        # The prompt opened the reasoning and the turn ended, yet the text never closes it:
        # the closing tag was a special token the server's detokenizer skipped.
        raise Unfaithful(THINK_TAGS_NOT_IN_TEXT)
    return gen.content  # no parser: the text as generated, tags included


def build_sample(tokenizer: Any, prompt: list[dict[str, Any]], gen: Generated, eot_id: int | None = None,
                 tags_special: bool | None = None) -> Sample:
    """The sample's tokens and loss mask (1 on the response, 0 on the prompt)."""
    if gen.finish_reason not in ("stop", "length"):
        raise Unfaithful(NOT_FINISHED)
    head = generation_prompt(tokenizer, prompt)
    head_ids = encode(tokenizer, head)
    differs = False
    if gen.prompt_token_ids is not None:
        differs = list(gen.prompt_token_ids) != head_ids
        head_ids = list(gen.prompt_token_ids)
    if gen.token_ids is not None:
        reply = list(gen.token_ids)
        source = "server_tokens"
    else:
        special = think_tags_are_special(tokenizer) if tags_special is None else tags_special
        text = response_text(head, gen, special)
        reply = encode(tokenizer, text)
        if tokenizer.decode(reply, skip_special_tokens=False, clean_up_tokenization_spaces=False) != text:
            raise Unfaithful(NOT_REPRODUCIBLE)
        if gen.finish_reason == "stop":
            stop = gen.stop_reason if isinstance(gen.stop_reason, int) else (
                end_of_turn_id(tokenizer) if eot_id is None else eot_id)
            if stop is not None:
                reply.append(int(stop))
        source = "text"
    return Sample(head_ids + reply, [0] * len(head_ids) + [1] * len(reply), source, differs)
