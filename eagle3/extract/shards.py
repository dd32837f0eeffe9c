"""Hidden-state shards: the contract between extract and train.

``shards/shard-NNNNNN.safetensors`` holds, for the samples it covers:

- ``input_ids``    int32 [T]          tokens, samples concatenated
- ``loss_mask``    uint8 [T]
- ``offsets``      int64 [n+1]        sample i is rows offsets[i]:offsets[i+1]
- ``sample_ids``   int64 [n]
- ``aux_hidden``   [T, 3*H]           HF hidden_states[k] for the 3 aux ids, concatenated
- ``final_hidden`` [T, H]             the last hidden state AFTER the final norm
                                      (teacher logits = lm_head(final_hidden))

Hidden tensors are bfloat16 (or float32 in tests), or float8_e4m3fn with float32
per-row scales: ``final_scale`` [T, 1] and ``aux_scale`` [T, 3] (one scale per aux
layer and row, because early and late layers differ in magnitude by orders and one
shared scale would flush the early layer's small values). :func:`read_shard`
dequantizes through :meth:`HiddenShard.aux_hidden_float`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import safe_open

SHARD_DIR = "shards"
INDEX = "index.json"
TARGET_HEAD = "target_head.safetensors"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn}


def shard_name(index: int) -> str:
    return f"{SHARD_DIR}/shard-{index:06d}.safetensors"


def quantize_fp8(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, D] → (float8_e4m3fn [T, D], float32 scale [T, groups]); x ≈ q * scale per group."""
    t, d = x.shape
    xg = x.float().view(t, groups, d // groups)  # [T, G, D/G]
    scale = (xg.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # [T, G, 1]
    q = (xg / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(t, d), scale.view(t, groups)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(float8 [T, D], scale [T, G]) → float32 [T, D]."""
    t, d = q.shape
    g = scale.shape[1]
    return (q.float().view(t, g, d // g) * scale.view(t, g, 1)).view(t, d)


@dataclass
class HiddenShard:
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    offsets: torch.Tensor  # int64 [n+1]
    sample_ids: torch.Tensor  # int64 [n]
    aux_hidden: torch.Tensor  # [T, 3H] storage dtype
    final_hidden: torch.Tensor  # [T, H] storage dtype
    aux_scale: torch.Tensor | None = None  # float32 [T, 3] (fp8 only)
    final_scale: torch.Tensor | None = None  # float32 [T, 1] (fp8 only)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_samples(self) -> int:
        return int(self.sample_ids.numel())

    @property
    def storage_dtype(self) -> str:
        return str(self.final_hidden.dtype).removeprefix("torch.")

    def aux_hidden_float(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.aux_scale is not None:
            return dequantize_fp8(self.aux_hidden, self.aux_scale).to(dtype)
        return self.aux_hidden.to(dtype)

    def final_hidden_float(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.final_scale is not None:
            return dequantize_fp8(self.final_hidden, self.final_scale).to(dtype)
        return self.final_hidden.to(dtype)

    def sample(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "offsets": self.offsets,
            "sample_ids": self.sample_ids,
            "aux_hidden": self.aux_hidden,
            "final_hidden": self.final_hidden,
        }
        if self.aux_scale is not None and self.final_scale is not None:
            out["aux_scale"] = self.aux_scale
            out["final_scale"] = self.final_scale
        return out

    def validate(self, hidden_size: int | None = None) -> list[str]:
        """Content checks (deep verification); returns problems."""
        problems = []
        t = self.num_tokens
        rows = {k: int(v.shape[0]) for k, v in self.tensors().items() if k not in ("offsets", "sample_ids")}
        if any(r != t for r in rows.values()):
            problems.append(f"tensors disagree in token count: {rows}")
        if self.offsets.numel() != self.num_samples + 1 or int(self.offsets[0]) != 0 or int(self.offsets[-1]) != t:
            problems.append("offsets do not cover the shard's tokens")
        h = self.final_hidden.shape[1]
        if self.aux_hidden.shape[1] != 3 * h:
            problems.append(f"aux_hidden width {self.aux_hidden.shape[1]} != 3 x final width {h}")
        if hidden_size is not None and h != hidden_size:
            problems.append(f"final_hidden width {h} != target hidden size {hidden_size}")
        if (self.aux_scale is None) != (self.aux_hidden.dtype != torch.float8_e4m3fn):
            problems.append("float8 hidden states need scales (and only they have them)")
        return problems


_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_CHUNK = 8 << 20


def stream_safetensors(sink: BinaryIO, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write ``tensors`` in the safetensors format to a stream, straight from their memory.

    No serialized copy of the whole file is built (``safetensors.torch.save`` would double a
    multi-GB shard in host memory), and the bytes pass once through the store's writer
    (hashed and written, or uploaded, in one go). Writes release the GIL, so this runs
    beside extraction on a thread. Returns the bytes written.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    flat, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        flat.append(t.reshape(-1).view(torch.uint8))
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    sink.write(struct.pack("<Q", len(head)))
    sink.write(head)
    for raw in flat:
        view = memoryview(raw.numpy())
        for i in range(0, len(view), _CHUNK):
            sink.write(view[i : i + _CHUNK])
    return 8 + len(head) + offset


def write_shard_to(sink: BinaryIO, shard: HiddenShard) -> int:
    return stream_safetensors(sink, shard.tensors(), {"format": "eagle3.hidden.v1"})


def write_shard(path: Path, shard: HiddenShard) -> None:
    with open(path, "wb") as f:
        write_shard_to(f, shard)


def read_shard(path: Path | str) -> HiddenShard:
    with safe_open(str(path), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    return HiddenShard(
        t["input_ids"], t["loss_mask"], t["offsets"], t["sample_ids"], t["aux_hidden"], t["final_hidden"],
        t.get("aux_scale"), t.get("final_scale"),
    )
