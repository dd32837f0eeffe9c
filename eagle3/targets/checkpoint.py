"""Read a few tensors straight from the target's checkpoint files (no model is built).

The ``vllm`` extract engine never loads the target in this process, yet train needs the
target's embedding and lm_head (``target_head.safetensors``), and the final hidden state
vLLM hands out before the final norm needs that norm's weight. They are read by name from
the safetensors shards (``model.safetensors.index.json`` says which file holds which):
Kimi-K2.5 keeps them unquantized (``lm_head`` is in its quantization ignore list; norms are
never quantized), its text model under a ``language_model.`` prefix.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3.errors import StageError

INDEX = "model.safetensors.index.json"


def checkpoint_dir(source: str, cache_dir: str | None = None) -> Path:
    """A local directory holding the checkpoint (hub ids: the index and weight files downloaded)."""
    local = Path(source)
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, cache_dir=cache_dir, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:  # noqa: BLE001 (any hub failure is one line)
        raise StageError(f"cannot fetch the checkpoint of {source}: {e}") from None


def weight_map(root: Path) -> dict[str, str]:
    """Tensor name -> file name."""
    index = root / INDEX
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    out: dict[str, str] = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as s:
            out.update({k: f.name for k in s.keys()})
    if not out:
        raise StageError(f"{root} holds no safetensors weights")
    return out


def _find(names: list[str], suffix: str) -> str | None:
    hits = sorted((n for n in names if n.endswith(suffix) and "vision" not in n and "mtp" not in n), key=len)
    return hits[0] if hits else None


def target_head_tensors(root: Path, tied: bool = False) -> dict[str, torch.Tensor]:
    """``embed_tokens.weight`` and ``lm_head.weight`` as train reads them from ``target_head.safetensors``."""
    wmap = weight_map(root)
    names = list(wmap)
    embed = _find(names, "embed_tokens.weight")
    head = _find(names, "lm_head.weight") or (embed if tied else None)
    if embed is None or head is None:
        raise StageError(f"{root}: no embed_tokens.weight / lm_head.weight among the checkpoint's tensors")
    out = {}
    for ours, theirs in (("embed_tokens.weight", embed), ("lm_head.weight", head)):
        if any(n.startswith(theirs.removesuffix(".weight") + ".weight_") for n in names):
            raise StageError(f"{root}: {theirs} is quantized; train needs it in floating point")
        with safe_open(str(root / wmap[theirs]), framework="pt") as f:
            out[ours] = f.get_tensor(theirs).clone()
    return out


FINAL_NORM = "model.norm.weight"  # the decoder's final norm (HF Llama / DeepseekV3; Kimi: language_model.model.norm)


def final_norm_weight(root: Path) -> torch.Tensor:
    """The weight of the decoder's final RMSNorm (``model.norm.weight``, under any prefix), as stored."""
    wmap = weight_map(root)
    names = sorted((n for n in wmap if (n == FINAL_NORM or n.endswith("." + FINAL_NORM)) and "vision" not in n
                    and "mtp" not in n), key=len)
    if not names:
        raise StageError(f"{root}: no {FINAL_NORM} (the final norm) among the checkpoint's tensors")
    with safe_open(str(root / wmap[names[0]]), framework="pt") as f:
        return f.get_tensor(names[0]).clone()
