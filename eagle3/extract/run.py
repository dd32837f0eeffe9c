"""Extraction of one shard: length-bucketed forward batches through the hooked target."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.data.tokenized import TokenizedSamples
from eagle3.extract.batching import ShardPlan, plan_batches, right_pad
from eagle3.extract.capture import HiddenCapture
from eagle3.extract.shards import STORAGE_DTYPES, HiddenShard, quantize_fp8


@dataclass
class ShardStats:
    real_tokens: int = 0
    padded_tokens: int = 0
    forward_s: float = 0.0


def to_storage(x: torch.Tensor, storage_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, H] on any device → (stored [N, H], float32 scale [N, 1] for fp8 else None)."""
    if storage_dtype == "float8_e4m3fn":
        return quantize_fp8(x, groups=1)
    return x.to(STORAGE_DTYPES[storage_dtype]), None


def input_device(capture: HiddenCapture) -> torch.device:
    emb = capture.stack.base.get_input_embeddings() if hasattr(capture.stack.base, "get_input_embeddings") else None
    param = emb.weight if emb is not None else next(capture.stack.base.parameters())
    return param.device


def extract_shard(
    capture: HiddenCapture,
    data: TokenizedSamples,
    plan: ShardPlan,
    hidden_size: int,
    batch_tokens: int,
    storage_dtype: str,
    stats: ShardStats,
) -> HiddenShard:
    """Hidden states of samples ``plan.first:plan.end``, in sample order, in host memory."""
    device = input_device(capture)
    a, b = int(data.offsets[plan.first]), int(data.offsets[plan.end])
    offsets = data.offsets[plan.first : plan.end + 1] - a  # [n+1]
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    t, h = b - a, hidden_size
    fp8 = storage_dtype == "float8_e4m3fn"
    dtype = STORAGE_DTYPES[storage_dtype]
    aux = torch.empty((t, 3 * h), dtype=dtype)  # [T, 3H]
    final = torch.empty((t, h), dtype=dtype)  # [T, H]
    aux_scale = torch.empty((t, 3), dtype=torch.float32) if fp8 else None
    final_scale = torch.empty((t, 1), dtype=torch.float32) if fp8 else None

    for batch in plan_batches(lengths, batch_tokens):
        samples = [data.input_ids[a + int(offsets[j]) : a + int(offsets[j + 1])] for j in batch]
        ids, real = right_pad(samples)  # [B, Tmax], [B, Tmax]
        t0 = _sync_time(device)
        aux_states, final_state = capture.run_stack(ids.to(device))  # 3 x [B, Tmax, H], [B, Tmax, H]
        # Keep real tokens only (row-major: sample by sample), convert on device, copy once.
        rows = real.flatten().nonzero().squeeze(1)  # [N] real-token rows of the flattened batch
        rows_on: dict[torch.device, torch.Tensor] = {}  # one index copy per device (device_map="auto")
        stored = [
            to_storage(s.flatten(0, 1).index_select(0, rows_on.setdefault(s.device, rows.to(s.device))), storage_dtype)
            for s in [*aux_states, final_state]
        ]  # 4 x ([N, H], scale [N, 1] | None)
        host = [(q.cpu(), None if sc is None else sc.cpu()) for q, sc in stored]
        stats.forward_s += _sync_time(device) - t0
        stats.real_tokens += int(real.sum())
        stats.padded_tokens += real.numel()
        src = 0
        for j in batch:
            dst, n = slice(int(offsets[j]), int(offsets[j + 1])), lengths[j]
            for g, (q, sc) in enumerate(host[:3]):
                aux[dst, g * h : (g + 1) * h] = q[src : src + n]
                if aux_scale is not None and sc is not None:
                    aux_scale[dst, g : g + 1] = sc[src : src + n]
            final[dst] = host[3][0][src : src + n]
            if final_scale is not None and host[3][1] is not None:
                final_scale[dst] = host[3][1][src : src + n]
            src += n

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


def _sync_time(device: torch.device) -> float:
    import time

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
