"""A drafter as the directory vLLM and SGLang load: the one writer of that format.

``write_export`` turns a drafter's weights (the exportable key list), its config, the vocab
mapping and the aux layer ids into ``config.json`` (:mod:`eagle3.export.vllm_config`),
``model.safetensors`` (bf16 weights under the names vLLM's ``llama_eagle3.py`` maps, plus
``d2t``, ``t2d`` when the draft vocab is smaller than the target's) and ``SERVING.md``. The
export stage writes its output with it; so does anything else that exports a drafter (the
quality race's checkpoints along training).

A full draft vocab (draft vocab = target vocab, an identity mapping) is written without
``d2t``/``t2d``: vLLM 0.30+ builds no ``draft_id_to_target_id`` then and its loader refuses a
``d2t``; 0.22.1-0.29 keep a zero offset table the absent ``d2t`` leaves as it is; SGLang maps
nothing when it is absent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.drafter.adapter import EXPORT_KEYS, check_weights
from eagle3.drafter.model import DrafterConfig
from eagle3.errors import StageError
from eagle3.export.vllm_config import build_vllm_config
from eagle3.targets.aux_layers import Family, family_names, to_sglang
from eagle3.vllm_version import SUPPORTED as VLLM_SUPPORTED
from eagle3.vocab.mapping import validate_vocab_mapping

CONFIG = "config.json"
MODEL = "model.safetensors"
SERVING = "SERVING.md"
FILES = (CONFIG, MODEL, SERVING)
EXPORT_DTYPE = torch.bfloat16
SGLANG_VERSION = "0.5.23"


@dataclass(frozen=True)
class ServingFacts:
    """What the export says about serving its drafter beyond the drafter itself."""

    family: Family | None = None  # the target's family: eagle_config ids for SGLang; None: not for SGLang
    target_dtype: str | None = None  # the dtype the hidden states were extracted in
    num_speculative_tokens: int | None = None  # the depth the drafter was trained to draft (train.ttt_steps)


def full_vocab(dcfg: DrafterConfig) -> bool:
    return dcfg.draft_vocab_size == dcfg.vocab_size


def read_d2t(weights: Path, draft_vocab_size: int) -> torch.Tensor:
    """An export's ``d2t`` (int64 [draft vocab]); all zeros (the identity) where a full-vocab export has none."""
    with safe_open(str(weights), framework="pt") as f:
        if "d2t" in f.keys():  # noqa: SIM118 (a safetensors handle)
            return f.get_tensor("d2t")
    return torch.zeros(draft_vocab_size, dtype=torch.int64)


def serving_note(aux_ids: list[int], facts: ServingFacts = ServingFacts()) -> str:
    """How to serve this directory; the aux ids in both engines' conventions, computed, not copied."""
    k = facts.num_speculative_tokens or 3
    dtype = f" --dtype {facts.target_dtype}" if facts.target_dtype else ""
    trained = (f"It was trained to draft {facts.num_speculative_tokens} tokens ahead (train.ttt_steps): "
               "num_speculative_tokens below is that depth; fewer may serve faster where later drafts are "
               "rarely accepted, more drafts past it are untrained.\n" if facts.num_speculative_tokens else "")
    served = (f"The hidden states were extracted with the target in {facts.target_dtype}: serve the target in "
              f"{facts.target_dtype} (`--dtype` below), or the drafter sees hidden states it did not learn.\n"
              if facts.target_dtype else "")
    head = f"""# Serving this EAGLE-3 drafter

Trained on the target's aux hidden states of layers {aux_ids} in vLLM's convention
(id k = the input of decoder layer k = HF hidden_states[k]).
{served}{trained}
## vLLM ({VLLM_SUPPORTED})

vLLM reads `eagle_aux_hidden_state_layer_ids` = {aux_ids} from config.json (top level):

    vllm serve TARGET{dtype} \\
        --speculative-config '{{"method": "eagle3", "model": "THIS_DIR", "num_speculative_tokens": {k}}}'
"""
    if facts.family is None:
        return head + "\nThis export is for vLLM only: `eagle_config` carries no ids for SGLang.\n"
    return head + f"""
## SGLang ({SGLANG_VERSION})

SGLang reads only `eagle_config.eagle_aux_hidden_state_layer_ids` = {to_sglang(aux_ids, facts.family)}. For a
{facts.family.name}-family target it {facts.family.sglang_rule}, which captures the same layers {aux_ids}:

    python -m sglang.launch_server --model-path TARGET{dtype} --speculative-algorithm EAGLE3 \\
        --speculative-draft-model-path THIS_DIR --speculative-num-steps {k} \\
        --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}

Never copy an id list from one engine's key to the other's: they differ on purpose, and by
target family.
"""


def export_tensors(weights: dict[str, torch.Tensor], d2t: torch.Tensor, t2d: torch.Tensor,
                   dcfg: DrafterConfig) -> dict[str, torch.Tensor]:
    out = {k: weights[k].to(EXPORT_DTYPE).contiguous() for k in EXPORT_KEYS}
    if not full_vocab(dcfg):
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
    if full_vocab(dcfg) and d2t.numel() == dcfg.draft_vocab_size and bool(d2t.any()):
        problems.append(f"{mapping_name}: a full draft vocab must map draft id i to target id i (d2t all zero), "
                        "since the export carries no d2t then")
    return problems


def sglang_problem(aux_ids: list[int], family: Family | None, target: str) -> str | None:
    """Why SGLang cannot serve a drafter on these ids for this target (None: it can)."""
    if family is None:
        return (f"SGLang's aux id rule for {target} is not known here (known: {family_names()}); "
                "set export.sglang: false to export for vLLM only")
    try:
        to_sglang(aux_ids, family)
    except ValueError as e:
        return (f"{e}; choose target.aux_layer_ids SGLang can express for {target}, or set export.sglang: false "
                "to export for vLLM only")
    return None


def write_export(out_dir: Path, dcfg: DrafterConfig, weights: dict[str, torch.Tensor], d2t: torch.Tensor,
                 t2d: torch.Tensor, aux_ids: list[int] | None = None,
                 facts: ServingFacts = ServingFacts()) -> dict[str, Any]:
    """Write the export directory (FILES); its stats. ``aux_ids`` default to the drafter config's.
    A drafter, mapping and ids that do not fit together raise StageError naming the first problem."""
    aux_ids = dcfg.aux_layer_ids if aux_ids is None else [int(i) for i in aux_ids]
    problems = export_problems(dcfg, weights, d2t, t2d, aux_ids)
    if facts.family is not None:
        problems += [p for p in [sglang_problem(aux_ids, facts.family, "the target")] if p]
    if problems:
        raise StageError(problems[0])
    return write_checked_export(out_dir, dcfg, weights, d2t, t2d, aux_ids, facts)


def write_checked_export(out_dir: Path, dcfg: DrafterConfig, weights: dict[str, torch.Tensor], d2t: torch.Tensor,
                         t2d: torch.Tensor, aux_ids: list[int], facts: ServingFacts = ServingFacts()) -> dict[str, Any]:
    """:func:`write_export` for pieces the caller already ran :func:`export_problems` and
    :func:`sglang_problem` on (the export stage, which adds checks of its own against extract's
    index and the target)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = export_tensors(weights, d2t, t2d, dcfg)
    save_file(tensors, str(out_dir / MODEL), metadata={"format": "pt"})
    sglang_ids = to_sglang(aux_ids, facts.family) if facts.family is not None else None
    config = build_vllm_config(dcfg, aux_ids, sglang_ids, facts.family)
    (out_dir / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / SERVING).write_text(serving_note(aux_ids, facts))
    return {
        "aux_layer_ids": aux_ids,
        "sglang_aux_layer_ids": sglang_ids,
        "target_family": facts.family.name if facts.family is not None else None,
        "target_dtype": facts.target_dtype,
        "num_speculative_tokens": facts.num_speculative_tokens,
        "draft_vocab_size": dcfg.draft_vocab_size,
        "target_vocab_size": dcfg.vocab_size,
        "vocab_mapping": "d2t, t2d" if "d2t" in tensors else "none (full vocab)",
        "max_position_embeddings": dcfg.max_position_embeddings,
        "parameters": sum(t.numel() for k, t in tensors.items() if k not in ("d2t", "t2d")),
        "dtype": "bfloat16",
    }
