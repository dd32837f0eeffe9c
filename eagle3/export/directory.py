"""A drafter as the directory vLLM and SGLang load: the one writer of that format.

``write_export`` turns a drafter's weights (the exportable key list), its config, the vocab
mapping and the aux layer ids into ``config.json`` (:mod:`eagle3.export.vllm_config`),
``model.safetensors`` (bf16 weights under the names vLLM's ``llama_eagle3.py`` maps, plus
``d2t``, ``t2d``) and ``SERVING.md``. The export stage writes its output with it; so does
anything else that exports a drafter (the quality race's checkpoints along training).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle3.drafter.adapter import EXPORT_KEYS, check_weights
from eagle3.drafter.model import DrafterConfig
from eagle3.errors import StageError
from eagle3.export.vllm_config import build_vllm_config
from eagle3.targets.aux_layers import to_sglang
from eagle3.vocab.mapping import validate_vocab_mapping

CONFIG = "config.json"
MODEL = "model.safetensors"
SERVING = "SERVING.md"
FILES = (CONFIG, MODEL, SERVING)
EXPORT_DTYPE = torch.bfloat16


def serving_note(aux_ids: list[int]) -> str:
    """How to serve this directory; the aux ids in both engines' conventions, computed, not copied."""
    sglang = to_sglang(aux_ids)
    return f"""# Serving this EAGLE-3 drafter

Trained on the target's aux hidden states of layers {aux_ids} in vLLM's convention
(id k = the input of decoder layer k = HF hidden_states[k]).

vLLM reads `eagle_aux_hidden_state_layer_ids` = {aux_ids} from config.json (top level):

    vllm serve TARGET --speculative-config '{{"method": "eagle3", "model": "THIS_DIR", "num_speculative_tokens": 5}}'

SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` = {sglang} and adds 1
(its ids mean "output of layer i"), which captures the same layers {aux_ids}:

    python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 \\
        --speculative-draft-model-path THIS_DIR --speculative-num-steps 5 \\
        --speculative-eagle-topk 1 --speculative-num-draft-tokens 6

Never copy an id list from one engine's key to the other's: they differ by one on purpose.
"""


def export_tensors(weights: dict[str, torch.Tensor], d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {k: weights[k].to(EXPORT_DTYPE).contiguous() for k in EXPORT_KEYS}
    out["d2t"] = d2t.to(torch.int64).contiguous()
    out["t2d"] = t2d.to(torch.bool).contiguous()
    return out


def export_problems(dcfg: DrafterConfig, weights: dict[str, torch.Tensor], d2t: torch.Tensor, t2d: torch.Tensor,
                    aux_ids: list[int], weights_name: str = "drafter weights",
                    mapping_name: str = "vocab mapping") -> list[str]:
    """Why these pieces do not make one loadable drafter (empty when they do)."""
    problems = check_weights(dcfg, {k: tuple(v.shape) for k, v in weights.items()}, weights_name)
    problems += [f"{mapping_name}: {p}" for p in validate_vocab_mapping(d2t, t2d, dcfg.vocab_size)]
    if d2t.numel() != dcfg.draft_vocab_size:
        problems.append(f"vocab mapping has {d2t.numel()} draft tokens, the drafter {dcfg.draft_vocab_size}")
    if dcfg.aux_layer_ids != list(aux_ids):
        problems.append(f"drafter was configured with aux ids {dcfg.aux_layer_ids}, extract captured {list(aux_ids)}")
    return problems


def write_export(out_dir: Path, dcfg: DrafterConfig, weights: dict[str, torch.Tensor], d2t: torch.Tensor,
                 t2d: torch.Tensor, aux_ids: list[int] | None = None) -> dict[str, Any]:
    """Write the export directory (FILES); its stats. ``aux_ids`` default to the drafter config's.
    A drafter, mapping and ids that do not fit together raise StageError naming the first problem."""
    aux_ids = dcfg.aux_layer_ids if aux_ids is None else [int(i) for i in aux_ids]
    problems = export_problems(dcfg, weights, d2t, t2d, aux_ids)
    if problems:
        raise StageError(problems[0])
    return write_checked_export(out_dir, dcfg, weights, d2t, t2d, aux_ids)


def write_checked_export(out_dir: Path, dcfg: DrafterConfig, weights: dict[str, torch.Tensor], d2t: torch.Tensor,
                         t2d: torch.Tensor, aux_ids: list[int]) -> dict[str, Any]:
    """:func:`write_export` for pieces the caller already ran :func:`export_problems` on (the export stage,
    which adds checks of its own against extract's index and the target)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = export_tensors(weights, d2t, t2d)
    save_file(tensors, str(out_dir / MODEL), metadata={"format": "pt"})
    config = build_vllm_config(dcfg, aux_ids)
    (out_dir / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / SERVING).write_text(serving_note(aux_ids))
    return {
        "aux_layer_ids": aux_ids,
        "sglang_aux_layer_ids": to_sglang(aux_ids),
        "draft_vocab_size": dcfg.draft_vocab_size,
        "target_vocab_size": dcfg.vocab_size,
        "max_position_embeddings": dcfg.max_position_embeddings,
        "parameters": sum(t.numel() for k, t in tensors.items() if k not in ("d2t", "t2d")),
        "dtype": "bfloat16",
    }
