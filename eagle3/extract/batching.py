"""Shard and batch planning for extraction: pure functions over sample lengths.

Shard boundaries depend only on the sample lengths and ``shard_tokens`` (samples are
taken in tokenized order), so a resumed run cuts exactly the same shards and can skip
the ones a previous attempt finished. Inside a shard, samples are length-bucketed into
forward batches so right-padding stays small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardPlan:
    index: int
    first: int  # first sample (index into the tokenized samples)
    end: int  # one past the last sample
    num_tokens: int


def plan_shards(lengths: torch.Tensor, shard_tokens: int) -> list[ShardPlan]:
    """Consecutive sample ranges; a shard closes once it holds >= shard_tokens tokens."""
    plans: list[ShardPlan] = []
    first, tokens = 0, 0
    for i, n in enumerate(lengths.tolist()):
        tokens += n
        if tokens >= shard_tokens:
            plans.append(ShardPlan(len(plans), first, i + 1, tokens))
            first, tokens = i + 1, 0
    if first < len(lengths):
        plans.append(ShardPlan(len(plans), first, len(lengths), tokens))
    return plans


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sample positions into batches of at most ``batch_tokens`` padded tokens.

    Sorted by length (longest first) so each batch holds samples of similar length; the
    budget counts padded tokens (batch size x longest sample) because that is what the
    forward pass allocates. A sample longer than the budget gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def padded_tokens(lengths: list[int], batches: list[list[int]]) -> int:
    return sum(len(b) * max(lengths[i] for i in b) for b in batches)


def right_pad(samples: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D id tensors into ``[B, T_max]`` (right-padded) and a bool mask of real tokens."""
    longest = max(int(s.numel()) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    real = torch.zeros((len(samples), longest), dtype=torch.bool)
    for row, s in enumerate(samples):
        ids[row, : s.numel()] = s.long()
        real[row, : s.numel()] = True
    return ids, real
