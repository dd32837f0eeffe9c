"""From response records to training samples: validate, render, tokenize, count.

A *record* is one line of ``raw_responses.jsonl``: the prompt, the target's response
(content, reasoning, finish reason, usage) or the error that ended its request. A
record that fails validation is counted by reason and marked ``excluded``; it never
reaches the tokenized data.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3.generate.client import ChatOutcome
from eagle3.generate.prompts import Prompt
from eagle3.generate.reasoning import REASONING_FIELDS, split_reasoning
from eagle3.generate.render import Generated, Unfaithful, build_sample, end_of_turn_id, think_tags_are_special
from eagle3.generate.tokenized import TokenizedSamples, from_lists

# Exclusion reasons (keys of the metadata's ``excluded`` counts).
FAILED, EMPTY, NO_REASONING, TOO_LONG = "request_failed", "empty", "missing_reasoning", "too_long"


def outcome_record(prompt: Prompt, outcome: ChatOutcome) -> dict[str, Any]:
    """The raw-response record of one request."""
    rec: dict[str, Any] = {"id": prompt.sample_id, "messages": prompt.messages, "attempts": outcome.attempts}
    if outcome.response is None:
        return {**rec, "error": outcome.error}
    choice = outcome.response["choices"][0]
    message = choice.get("message") or {}
    split = split_reasoning(message)
    return {**rec, "response": message, "content": split.content, "reasoning": split.reasoning,
            "reasoning_source": split.source, "finish_reason": choice.get("finish_reason"),
            "stop_reason": choice.get("stop_reason"), "token_ids": choice.get("token_ids"),
            "prompt_token_ids": outcome.response.get("prompt_token_ids"),
            "usage": outcome.response.get("usage"), "error": None}


def generated(rec: dict[str, Any]) -> Generated:
    """The response of a record as the endpoint reported it: raw strings, server tokens if any."""
    message = rec.get("response") or {}
    reasoning = next((message[k] for k in REASONING_FIELDS if isinstance(message.get(k), str)), None)
    return Generated(content=message.get("content") or "", reasoning=reasoning,
                     finish_reason=rec.get("finish_reason"), token_ids=rec.get("token_ids"),
                     prompt_token_ids=rec.get("prompt_token_ids"), stop_reason=rec.get("stop_reason"))


def merge_records(*batches: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """One record per sample id; a success beats a failure, a later record beats an earlier one."""
    out: dict[int, dict[str, Any]] = {}
    for batch in batches:
        for rec in batch:
            prev = out.get(rec["id"])
            if prev is None or rec.get("error") is None or prev.get("error") is not None:
                out[rec["id"]] = rec
    return out


@dataclass
class BuildStats:
    requested: int = 0
    succeeded: int = 0
    failed: int = 0
    excluded: Counter = field(default_factory=Counter)
    reasoning_captured: int = 0
    reasoning_sources: Counter = field(default_factory=Counter)
    response_tokens_from: Counter = field(default_factory=Counter)
    prompt_tokens_differ: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    truncated_to_max_length: int = 0
    kept: int = 0
    tokens: int = 0
    assistant_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested, "succeeded": self.succeeded, "failed": self.failed,
            "excluded": dict(sorted(self.excluded.items())), "excluded_total": sum(self.excluded.values()),
            "kept": self.kept,
            "reasoning_captured": self.reasoning_captured,
            "reasoning_capture_rate": round(self.reasoning_captured / self.succeeded, 4) if self.succeeded else 0.0,
            "reasoning_sources": dict(sorted(self.reasoning_sources.items())),
            "response_tokens_from": dict(sorted(self.response_tokens_from.items())),
            "server_prompt_tokens_differ_from_template": self.prompt_tokens_differ,
            "finish_reasons": dict(sorted(self.finish_reasons.items())),
            "truncated_to_max_length": self.truncated_to_max_length,
            "tokens": self.tokens, "assistant_tokens": self.assistant_tokens,
        }


def build_samples(records: list[dict[str, Any]], tokenizer: Any, max_length: int, drop_truncated: bool,
                  require_reasoning: bool) -> tuple[TokenizedSamples, BuildStats]:
    """Validate and tokenize records (sorted by id); marks each excluded record in place."""
    stats = BuildStats(requested=len(records))
    kept: list[tuple[int, list[int], list[int]]] = []
    template = (end_of_turn_id(tokenizer), think_tags_are_special(tokenizer))
    for rec in records:
        rec["excluded"] = _tokenize_one(rec, tokenizer, template, max_length, drop_truncated, require_reasoning,
                                        stats, kept)
        if rec["excluded"] is not None:
            stats.excluded[rec["excluded"]] += 1
    data = from_lists(kept)
    stats.kept = len(data)
    stats.tokens = data.num_tokens
    stats.assistant_tokens = int(data.loss_mask.sum())
    return data, stats


def _tokenize_one(rec: dict[str, Any], tokenizer: Any, template: tuple[int | None, bool], max_length: int,
                  drop_truncated: bool, require_reasoning: bool, stats: BuildStats, kept: list) -> str | None:
    if rec.get("error") is not None:
        stats.failed += 1
        return FAILED
    stats.succeeded += 1
    stats.finish_reasons[str(rec.get("finish_reason"))] += 1
    stats.reasoning_sources[rec.get("reasoning_source") or "none"] += 1
    content, reasoning = rec.get("content") or "", rec.get("reasoning")
    if reasoning:
        stats.reasoning_captured += 1
    if not content.strip() and not (reasoning or "").strip():
        return EMPTY
    if require_reasoning and not reasoning:
        return NO_REASONING
    try:
        sample = build_sample(tokenizer, rec["messages"], generated(rec), eot_id=template[0], tags_special=template[1])
    except Unfaithful as e:
        return e.reason
    stats.response_tokens_from[sample.response_from] += 1
    stats.prompt_tokens_differ += int(sample.prompt_differs)
    ids, mask = sample.input_ids, sample.loss_mask
    if len(ids) > max_length:
        if drop_truncated:
            return TOO_LONG
        ids, mask = ids[:max_length], mask[:max_length]
        stats.truncated_to_max_length += 1
        if not any(mask):
            return TOO_LONG
    kept.append((rec["id"], ids, mask))
    return None


def token_frequencies(data: TokenizedSamples, vocab_size: int) -> torch.Tensor:
    """counts int64 [vocab_size]: occurrences of each token id on loss-masked (assistant) tokens."""
    assistant = data.input_ids[data.loss_mask.bool()].long()  # [A]
    return torch.bincount(assistant, minlength=vocab_size)[:vocab_size] if assistant.numel() else \
        torch.zeros(vocab_size, dtype=torch.int64)
