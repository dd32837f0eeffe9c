"""Batches of hidden-state samples, streamed shard by shard.

Memory stays bounded by two shards per process (the one being cut into batches and the
next, read ahead on a thread): each epoch shuffles the shard order
(seeded), deals shards to ranks round-robin, and each rank cuts its current shard into
length-bucketed batches (samples of similar length together, at most ``batch_tokens``
padded tokens per batch), in a seeded random order. Everything depends only on
(seed, epoch, shard contents), so a resumed run replays the same batches.

Held-out samples (``eval_fraction``) are picked by a hash of the sample id: the same
samples are held out however the data is sharded.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from eagle3.errors import StageError
from eagle3.extract.shards import HiddenShard


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

    def tensors(self) -> tuple[Tensor, ...]:
        return self.input_ids, self.loss_mask, self.aux_hidden, self.final_hidden

    def to(self, device: torch.device) -> Batch:
        nb = device.type == "cuda"
        return Batch(*(t.to(device, non_blocking=nb) for t in self.tensors()), self.tokens)


def collate(shard: HiddenShard, samples: list[int], max_seq_len: int, dtype: torch.dtype, pad_to: int = 1, pin: bool = False) -> Batch:
    """Right-pad the chosen samples of a shard (cut to max_seq_len) into one batch
    (in page-locked memory when ``pin``, for asynchronous copies to the GPU)."""
    spans = []
    for i in samples:
        s = shard.sample(i)
        spans.append(slice(s.start, min(s.stop, s.start + max_seq_len)))
    t = max(sp.stop - sp.start for sp in spans)
    t = -(-t // pad_to) * pad_to
    b, h = len(spans), shard.final_hidden.shape[1]
    ids = torch.zeros(b, t, dtype=torch.int64, pin_memory=pin)
    mask = torch.zeros(b, t, dtype=torch.uint8, pin_memory=pin)
    aux = torch.zeros(b, t, 3 * h, dtype=dtype, pin_memory=pin)
    final = torch.zeros(b, t, h, dtype=dtype, pin_memory=pin)
    for r, sp in enumerate(spans):
        n = sp.stop - sp.start
        part = HiddenShard(
            shard.input_ids[sp], shard.loss_mask[sp], shard.offsets, shard.sample_ids, shard.aux_hidden[sp], shard.final_hidden[sp],
            None if shard.aux_scale is None else shard.aux_scale[sp], None if shard.final_scale is None else shard.final_scale[sp],
        )
        ids[r, :n] = part.input_ids.long()
        mask[r, :n] = part.loss_mask
        aux[r, :n] = part.aux_hidden_float(dtype)
        final[r, :n] = part.final_hidden_float(dtype)
    return Batch(ids, mask, aux, final, sum(sp.stop - sp.start for sp in spans))


@dataclass
class DataPlan:
    shards: list[ShardRef]
    batch_tokens: int
    max_seq_len: int
    eval_fraction: float
    seed: int
    rank: int = 0
    world: int = 1

    def rank_shards(self, epoch: int) -> list[int]:
        return shard_order(len(self.shards), epoch, self.seed)[self.rank :: self.world]

    def shard_batches(self, shard: HiddenShard, shard_idx: int, epoch: int, train: bool) -> list[list[int]]:
        """Batches (sample indices) of one shard: its training or its held-out samples."""
        cap = min(self.max_seq_len, self.batch_tokens)
        keep = [i for i in range(shard.num_samples) if is_eval_sample(int(shard.sample_ids[i]), self.eval_fraction, self.seed) != train]
        lengths = [min(int(shard.offsets[i + 1] - shard.offsets[i]), cap) for i in keep]
        rng = random.Random(f"{self.seed}:{epoch}:{shard_idx}:{'train' if train else 'eval'}")
        return [[keep[j] for j in b] for b in plan_batches(lengths, self.batch_tokens, rng)]

    def estimated_batches_per_epoch(self) -> int:
        """Per rank, for the LR schedule's horizon (padding makes the true count a bit higher)."""
        tokens = sum(s.num_tokens for s in self.shards) * (1 - self.eval_fraction)
        return max(1, int(tokens // (self.batch_tokens * self.world)))

    def iterate(
        self, open_shard: Callable[[str], HiddenShard], epoch: int, dtype: torch.dtype, skip: int = 0, train: bool = True,
        pad_to: int = 1, pin: bool = False,
    ) -> Iterator[Batch]:
        """This rank's batches of one epoch, skipping the first ``skip`` (resume).

        The next shard is read on a thread while this one is cut into batches, so a
        shard boundary does not stall training (host memory: two shards)."""
        order = self.rank_shards(epoch)
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
                        yield collate(shard, b, min(self.max_seq_len, self.batch_tokens), dtype, pad_to, pin)
                    seen += 1
                del shard
        finally:
            # Left early (max_steps, the eval's batch cap, a stop): do not wait for a read nobody needs.
            pool.shutdown(wait=False, cancel_futures=True)
