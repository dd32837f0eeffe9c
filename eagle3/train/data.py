"""Batches of hidden-state samples, streamed shard by shard.

Memory stays bounded by two shards per process (the one being cut into batches and the
next, read ahead on a thread): each epoch shuffles the shard order
(seeded), deals shards to ranks round-robin, and each rank cuts its current shard into
batches in a seeded random order. Everything depends only on
(seed, epoch, shard contents), so a resumed run replays the same batches.

Two layouts: *packed* (training's default) concatenates samples into rows of
``max_seq_len`` tokens with a document id per token (attention and the TTT shifts stay
inside a sample), ``batch_tokens // max_seq_len`` rows a batch, so every batch has the
same shape — compiled kernels are built once, no token is padding but a row's tail, and
attention memory stays that of ``max_seq_len``-long rows (the dense-mask path grows with
the square of a row); *padded* puts samples of similar length together,
right-padded to the longest, at most ``batch_tokens`` padded tokens per batch (held-out
evaluation, and ``train.pack: false``).

Held-out samples (``eval_fraction``) are picked by a hash of the sample id: the same
samples are held out however the data is sharded.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from eagle3.errors import StageError
from eagle3.extract.shards import HiddenShard, dequantize_fp8


@dataclass(frozen=True)
class ShardRef:
    name: str  # object name under the extract stage, e.g. shards/shard-000000.safetensors
    num_samples: int
    num_tokens: int


def shard_refs(index: dict) -> list[ShardRef]:
    """The shard list of extract's index.json; a malformed index is one clear error."""
    try:
        refs = [ShardRef(str(s["name"]), int(s["num_samples"]), int(s["num_tokens"])) for s in index["shards"]]
    except (KeyError, TypeError, ValueError) as e:
        raise StageError(f"extract index.json: malformed shard list ({e!r})") from None
    if not refs:
        raise StageError("extract index.json lists no shards: nothing to train on")
    return refs


def is_eval_sample(sample_id: int, fraction: float, seed: int) -> bool:
    """Deterministic hold-out by a hash of the sample id (Knuth multiplicative)."""
    if fraction <= 0:
        return False
    h = ((int(sample_id) + 0x9E3779B9 * (seed + 1)) * 2654435761) % (1 << 32)
    return h / float(1 << 32) < fraction


def plan_batches(lengths: list[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Sample indices grouped into batches of similar length with B·max_len <= batch_tokens.

    Samples are sorted by length (random tie-break), cut greedily, then the batches
    are shuffled. A sample longer than batch_tokens must be cut by the caller.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = max([lengths[j] for j in cur] + [lengths[i]])
        if cur and longest * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def plan_packs(lengths: list[int], row_tokens: int, rng: random.Random) -> list[list[int]]:
    """Sample indices grouped into rows of at most ``row_tokens`` tokens (first fit, longest
    first, random tie-break), rows shuffled. A sample longer than a row must be cut by the caller."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], rng.random()))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        r = next((r for r, free in enumerate(room) if free >= n), None)
        if r is None:
            rows.append([])
            room.append(row_tokens)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= n
    for row in rows:
        rng.shuffle(row)
    rng.shuffle(rows)
    return rows


def shard_order(num_shards: int, epoch: int, seed: int) -> list[int]:
    order = list(range(num_shards))
    random.Random(f"{seed}:{epoch}:shards").shuffle(order)
    return order


@dataclass
class Batch:
    input_ids: Tensor  # int64 [B, T]
    loss_mask: Tensor  # uint8 [B, T]
    aux_hidden: Tensor  # [B, T, 3Ht]
    final_hidden: Tensor  # [B, T, Ht]
    tokens: int  # real (unpadded) tokens
    doc_ids: Tensor | None = None  # int32 [B, T], packed rows: which sample each token is of (-1: padding)
    row_counts: list[int] | None = None  # eagle3.drafter.loss.row_counts, counted where the batch is made
    # Packed rows on flex attention: every TTT step's block lists, made where the batch is made
    # (eagle3.drafter.masks.pack_block_lists: one flat int32 tensor and where each list lies in it).
    block_lists: Tensor | None = None
    block_layout: Any = None
    # fp8 shards collated with raw_fp8: aux/final hidden stay float8 (half the bytes to copy) with
    # their per-token scales [B, T, G], dequantized where the batch is used (:meth:`dequantized`).
    aux_scale: Tensor | None = None
    final_scale: Tensor | None = None

    _TENSORS = ("input_ids", "loss_mask", "aux_hidden", "final_hidden", "doc_ids", "block_lists", "aux_scale", "final_scale")

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(t for name in self._TENSORS if (t := getattr(self, name)) is not None)

    def to(self, device: torch.device) -> Batch:
        nb = device.type == "cuda"
        moved = {name: t.to(device, non_blocking=nb) for name in self._TENSORS if (t := getattr(self, name)) is not None}
        return replace(self, **moved)

    def dequantized(self, dtype: torch.dtype) -> Batch:
        """Hidden states in ``dtype`` (a batch of raw fp8 states and scales is dequantized here, on its device)."""
        if self.aux_scale is None or self.final_scale is None:
            return self

        def deq(q: Tensor, scale: Tensor) -> Tensor:
            b, t, d = q.shape
            return dequantize_fp8(q.view(b * t, d), scale.view(b * t, -1)).to(dtype).view(b, t, d)

        return replace(self, aux_hidden=deq(self.aux_hidden, self.aux_scale), final_hidden=deq(self.final_hidden, self.final_scale),
                       aux_scale=None, final_scale=None)


def _spans(shard: HiddenShard, samples: list[int], max_seq_len: int) -> list[slice]:
    spans = []
    for i in samples:
        s = shard.sample(i)
        spans.append(slice(s.start, min(s.stop, s.start + max_seq_len)))
    return spans


class _Buffers:
    """A batch's host tensors [B, T, ...]: ids, loss mask, aux and final hidden states in ``dtype``
    — or, with ``raw_fp8`` and an fp8 shard, the shard's float8 states and their scales."""

    def __init__(self, shard: HiddenShard, b: int, t: int, dtype: torch.dtype, pin: bool, zero: bool, raw_fp8: bool) -> None:
        new = torch.zeros if zero else torch.empty
        h = shard.final_hidden.shape[1]
        raw = raw_fp8 and shard.aux_scale is not None and shard.final_scale is not None
        hd = shard.aux_hidden.dtype if raw else dtype
        self.ids, self.mask = new(b, t, dtype=torch.int64, pin_memory=pin), new(b, t, dtype=torch.uint8, pin_memory=pin)
        self.aux, self.final = new(b, t, 3 * h, dtype=hd, pin_memory=pin), new(b, t, h, dtype=hd, pin_memory=pin)
        self.scales = ((new(b, t, shard.aux_scale.shape[1], dtype=torch.float32, pin_memory=pin),
                        new(b, t, shard.final_scale.shape[1], dtype=torch.float32, pin_memory=pin)) if raw else None)

    def put(self, shard: HiddenShard, sp: slice, dtype: torch.dtype, r: int, at: int, all_tokens: bool = False) -> None:
        """Copy one sample's tokens (shard rows ``sp``) into row ``r`` from column ``at``: raw fp8
        states and their scales, or the states in ``dtype`` (dequantized when the shard is fp8).
        ``all_tokens``: the loss mask is 1 on every token of the sample, not the shard's."""
        w = slice(at, at + sp.stop - sp.start)
        self.ids[r, w].copy_(shard.input_ids[sp].long())
        if all_tokens:
            self.mask[r, w].fill_(1)
        else:
            self.mask[r, w].copy_(shard.loss_mask[sp])
        if self.scales is not None:
            self.aux[r, w].copy_(shard.aux_hidden[sp])
            self.final[r, w].copy_(shard.final_hidden[sp])
            self.scales[0][r, w].copy_(shard.aux_scale[sp])
            self.scales[1][r, w].copy_(shard.final_scale[sp])
            return
        part = HiddenShard(
            shard.input_ids[sp], shard.loss_mask[sp], shard.offsets, shard.sample_ids, shard.aux_hidden[sp], shard.final_hidden[sp],
            None if shard.aux_scale is None else shard.aux_scale[sp], None if shard.final_scale is None else shard.final_scale[sp],
        )
        self.aux[r, w].copy_(part.aux_hidden_float(dtype))
        self.final[r, w].copy_(part.final_hidden_float(dtype))

    def zero_tail(self, r: int, at: int) -> None:
        for x in (self.ids, self.mask, self.aux, self.final, *(self.scales or ())):
            x[r, at:] = 0

    def batch(self, tokens: int, doc_ids: Tensor | None = None) -> Batch:
        aux_scale, final_scale = self.scales or (None, None)
        return Batch(self.ids, self.mask, self.aux, self.final, tokens, doc_ids, aux_scale=aux_scale, final_scale=final_scale)


def collate(shard: HiddenShard, samples: list[int], max_seq_len: int, dtype: torch.dtype, pad_to: int = 1, pin: bool = False,
            raw_fp8: bool = False, all_tokens: bool = False) -> Batch:
    """Right-pad the chosen samples of a shard (cut to max_seq_len) into one batch
    (in page-locked memory when ``pin``, for asynchronous copies to the GPU; ``raw_fp8``:
    an fp8 shard's states stay fp8, see :meth:`Batch.dequantized`; ``all_tokens``: every
    token of a sample is in the loss mask, the prompt's too)."""
    spans = _spans(shard, samples, max_seq_len)
    t = max(sp.stop - sp.start for sp in spans)
    t = -(-t // pad_to) * pad_to
    buf = _Buffers(shard, len(spans), t, dtype, pin, True, raw_fp8)
    for r, sp in enumerate(spans):
        buf.put(shard, sp, dtype, r, 0, all_tokens)
    return buf.batch(sum(sp.stop - sp.start for sp in spans))


def collate_packed(shard: HiddenShard, rows: list[list[int]], max_seq_len: int, row_tokens: int, num_rows: int,
                   dtype: torch.dtype, pin: bool = False, raw_fp8: bool = False, all_tokens: bool = False) -> Batch:
    """[num_rows, row_tokens]: row r holds the samples ``rows[r]`` (each cut to max_seq_len) one
    after another, with each token's document id (its sample's place in the row; -1 on the
    padded tail, and on whole rows past ``len(rows)``, which keep the batch's shape)."""
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} packed rows exceed the batch's {num_rows}")
    # Every token but the tails is written below: only the tails are zeroed (84 MB a batch at the race's shape).
    buf = _Buffers(shard, num_rows, row_tokens, dtype, pin, False, raw_fp8)
    docs = torch.full((num_rows, row_tokens), -1, dtype=torch.int32, pin_memory=pin)
    total = 0
    for r in range(num_rows):
        at = 0
        for d, sp in enumerate(_spans(shard, rows[r], max_seq_len) if r < len(rows) else []):
            n = sp.stop - sp.start
            if at + n > row_tokens:
                raise ValueError(f"packed row of more than {row_tokens} tokens")
            buf.put(shard, sp, dtype, r, at, all_tokens)
            docs[r, at : at + n] = d
            at += n
        buf.zero_tail(r, at)
        total += at
    return buf.batch(total, docs)


@dataclass
class DataPlan:
    shards: list[ShardRef]
    batch_tokens: int
    max_seq_len: int
    eval_fraction: float
    seed: int
    rank: int = 0
    world: int = 1
    pack: bool = False  # training batches as packed rows (held-out batches are always padded)
    all_tokens: bool = False  # training batches teach every token, the prompt's too (held-out: the response's)

    def rank_shards(self, epoch: int) -> list[int]:
        return shard_order(len(self.shards), epoch, self.seed)[self.rank :: self.world]

    @property
    def row_cap(self) -> int:
        """Tokens of a sample at most (longer ones are cut), and of a packed row."""
        return min(self.max_seq_len, self.batch_tokens)

    @property
    def rows_per_batch(self) -> int:
        return max(1, self.batch_tokens // self.row_cap)

    def shard_batches(self, shard: HiddenShard, shard_idx: int, epoch: int, train: bool) -> list[list[Any]]:
        """Batches of one shard, its training or its held-out samples: sample indices per batch
        (padded), or per batch its rows' sample indices (packed)."""
        keep = [i for i in range(shard.num_samples) if is_eval_sample(int(shard.sample_ids[i]), self.eval_fraction, self.seed) != train]
        lengths = [min(int(shard.offsets[i + 1] - shard.offsets[i]), self.row_cap) for i in keep]
        rng = random.Random(f"{self.seed}:{epoch}:{shard_idx}:{'train' if train else 'eval'}")
        if self.packed(train):
            rows = [[keep[j] for j in row] for row in plan_packs(lengths, self.row_cap, rng)]
            n = self.rows_per_batch
            return [rows[i : i + n] for i in range(0, len(rows), n)]
        return [[keep[j] for j in b] for b in plan_batches(lengths, self.batch_tokens, rng)]

    def packed(self, train: bool) -> bool:
        return self.pack and train

    def estimated_batches_per_epoch(self) -> int:
        """Per rank, for the LR schedule's horizon (padding makes the true count a bit higher)."""
        tokens = sum(s.num_tokens for s in self.shards) * (1 - self.eval_fraction)
        return max(1, int(tokens // (self.batch_tokens * self.world)))

    def iterate(
        self, open_shard: Callable[[str], HiddenShard], epoch: int, dtype: torch.dtype, skip: int = 0, train: bool = True,
        pad_to: int = 1, pin: bool = False, raw_fp8: bool = False,
    ) -> Iterator[Batch]:
        """This rank's batches of one epoch, skipping the first ``skip`` (resume).

        The next shard is read on a thread while this one is cut into batches, so a
        shard boundary does not stall training (host memory: two shards). Packed rows
        are ``max_seq_len`` (at most ``batch_tokens``) rounded up to ``pad_to`` long."""
        order = self.rank_shards(epoch)
        cap = self.row_cap
        row_tokens = -(-cap // pad_to) * pad_to
        packed = self.packed(train)
        every = self.all_tokens and train
        seen = 0
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-read")
        try:
            upcoming = pool.submit(open_shard, self.shards[order[0]].name) if order else None
            for j, idx in enumerate(order):
                shard = upcoming.result()
                upcoming = pool.submit(open_shard, self.shards[order[j + 1]].name) if j + 1 < len(order) else None
                plans = self.shard_batches(shard, idx, epoch, train)
                if seen + len(plans) <= skip:
                    seen += len(plans)
                    continue
                for b in plans:
                    if seen >= skip:
                        yield (collate_packed(shard, b, cap, row_tokens, self.rows_per_batch, dtype, pin, raw_fp8, every)
                               if packed else collate(shard, b, cap, dtype, pad_to, pin, raw_fp8, every))
                    seen += 1
                del shard
        finally:
            # Left early (max_steps, the eval's batch cap, a stop): do not wait for a read nobody needs.
            pool.shutdown(wait=False, cancel_futures=True)
