"""Extraction of one shard: length-bucketed forward batches through the hooked target."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from eagle3.generate.tokenized import TokenizedSamples
from eagle3.extract.batching import ShardPlan, plan_batches, right_pad
from eagle3.targets.capture import HiddenCapture
from eagle3.extract.shards import STORAGE_DTYPES, HiddenShard, quantize_fp8


@dataclass
class ShardStats:
    real_tokens: int = 0
    padded_tokens: int = 0
    batches_s: float = 0.0  # wall seconds in the batch loops (forwards with the copies they overlap)


def to_storage(x: torch.Tensor, storage_dtype: str, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, D] on any device → (stored [N, D], float32 scale [N, groups] for fp8 else None)."""
    if storage_dtype == "float8_e4m3fn":
        return quantize_fp8(x, groups=groups)
    return x.to(STORAGE_DTYPES[storage_dtype]), None


def input_device(capture: HiddenCapture) -> torch.device:
    emb = capture.stack.base.get_input_embeddings() if hasattr(capture.stack.base, "get_input_embeddings") else None
    param = emb.weight if emb is not None else next(capture.stack.base.parameters())
    return param.device


def pack_real_tokens(states: list[torch.Tensor], real: torch.Tensor, storage_dtype: str
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """4 x [B, T, H] (aux..., final) → real tokens only, row-major, as one [N, 4H] in storage dtype.

    Computed where the final state lives (the last GPU under ``device_map="auto"``), so the
    host gets one contiguous copy per batch; fp8 scales come per state: [N, 4] float32.
    """
    dev = states[-1].device
    rows = real.flatten().nonzero().squeeze(1).to(dev, non_blocking=True)  # [N]
    packed = torch.cat([s.to(dev, non_blocking=True).flatten(0, 1).index_select(0, rows) for s in states], dim=1)
    return to_storage(packed, storage_dtype, groups=len(states))


class HostStaging:
    """Two reusable page-locked buffers for device→host copies that overlap the next forward.

    Batch i copies into slot i % 2 without blocking; its rows are placed into the shard
    while batch i+1 computes. Slot i % 2 is written again by batch i+2, after batch i was
    placed, so no copy overwrites rows still being read. On CPU the packed tensor is used as is.
    """

    def __init__(self) -> None:
        self._slots: list[list[torch.Tensor | None]] = [[None, None], [None, None]]

    def _buffer(self, slot: int, part: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._slots[slot][part]
        n = like.shape[0]
        if buf is None or buf.shape[0] < n or buf.shape[1:] != like.shape[1:] or buf.dtype != like.dtype:
            buf = torch.empty((max(n, 1), *like.shape[1:]), dtype=like.dtype, pin_memory=True)
            self._slots[slot][part] = buf
        return buf[:n]

    def copy(self, slot: int, q: torch.Tensor, scale: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event | None]:
        if q.device.type != "cuda":
            return q, scale, None
        host_q = self._buffer(slot, 0, q)
        host_q.copy_(q, non_blocking=True)
        host_scale = None
        if scale is not None:
            host_scale = self._buffer(slot, 1, scale)
            host_scale.copy_(scale, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(q.device))
        return host_q, host_scale, done


def shard_buffers(t: int, h: int, storage_dtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                                 torch.Tensor | None]:
    """A shard's host tensors, to be filled: aux [T, 3H], final [T, H] in the storage dtype, and
    for fp8 their per-token scales [T, 3] and [T, 1] (else None)."""
    dtype = STORAGE_DTYPES[storage_dtype]
    fp8 = storage_dtype == "float8_e4m3fn"
    return (torch.empty((t, 3 * h), dtype=dtype), torch.empty((t, h), dtype=dtype),
            torch.empty((t, 3), dtype=torch.float32) if fp8 else None,
            torch.empty((t, 1), dtype=torch.float32) if fp8 else None)


@torch.inference_mode()
def extract_shard(
    capture: HiddenCapture,
    data: TokenizedSamples,
    plan: ShardPlan,
    hidden_size: int,
    batch_tokens: int,
    storage_dtype: str,
    stats: ShardStats,
    staging: HostStaging | None = None,
) -> HiddenShard:
    """Hidden states of samples ``plan.first:plan.end``, in sample order, in host memory.

    The loop never waits for the GPU between batches: batch i's states go to pinned host
    memory asynchronously and are placed into the shard while batch i+1 runs.
    """
    device = input_device(capture)
    staging = staging or HostStaging()
    a, b = int(data.offsets[plan.first]), int(data.offsets[plan.end])
    offsets = data.offsets[plan.first : plan.end + 1] - a  # [n+1]
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    t, h = b - a, hidden_size
    aux, final, aux_scale, final_scale = shard_buffers(t, h, storage_dtype)

    def place(host_q: torch.Tensor, host_scale: torch.Tensor | None, done: torch.cuda.Event | None,
              batch: list[int]) -> None:
        if done is not None:
            done.synchronize()
        src = 0
        for j in batch:
            dst, n = slice(int(offsets[j]), int(offsets[j + 1])), lengths[j]
            aux[dst] = host_q[src : src + n, : 3 * h]
            final[dst] = host_q[src : src + n, 3 * h :]
            if aux_scale is not None and final_scale is not None and host_scale is not None:
                aux_scale[dst] = host_scale[src : src + n, :3]
                final_scale[dst] = host_scale[src : src + n, 3:]
            src += n

    t0 = time.perf_counter()
    pending = None
    for i, batch in enumerate(plan_batches(lengths, batch_tokens)):
        samples = [data.input_ids[a + int(offsets[j]) : a + int(offsets[j + 1])] for j in batch]
        ids, real = right_pad(samples)  # [B, Tmax], [B, Tmax]
        aux_states, final_state = capture.run_stack(ids.to(device))  # 3 x [B, Tmax, H], [B, Tmax, H]
        q, scale = pack_real_tokens([*aux_states, final_state], real, storage_dtype)  # [N, 4H], [N, 4] | None
        del aux_states, final_state
        copied = staging.copy(i % 2, q, scale)
        del q, scale
        stats.real_tokens += int(real.sum())
        stats.padded_tokens += real.numel()
        if pending is not None:
            place(*pending)
        pending = (*copied, batch)
    if pending is not None:
        place(*pending)
    stats.batches_s += time.perf_counter() - t0

    return HiddenShard(
        input_ids=data.input_ids[a:b].clone(),
        loss_mask=data.loss_mask[a:b].clone(),
        offsets=offsets.clone(),
        sample_ids=data.sample_ids[plan.first : plan.end].clone(),
        aux_hidden=aux,
        final_hidden=final,
        aux_scale=aux_scale,
        final_scale=final_scale,
    )
