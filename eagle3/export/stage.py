"""The export stage: the trained drafter as a directory vLLM and SGLang load.

``config.json`` (see :mod:`eagle3.export.vllm_config`) + ``model.safetensors`` holding
the drafter under the names vLLM's ``llama_eagle3.py`` maps (``fc.weight``,
``midlayer.*`` -> ``layers.0.*``, ``norm.weight``, ``lm_head.weight``), ``d2t`` (loaded as
``draft_id_to_target_id``) and ``t2d`` (skipped by vLLM, kept for SGLang and tools).
No ``embed_tokens``: both engines share the target's embedding when it is absent.
The aux ids come from extract's index (what the drafter was trained on) and must agree
with the drafter config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.context import StageContext
from eagle3.drafter.adapter import CONFIG as DRAFTER_CONFIG
from eagle3.drafter.adapter import EXPORT_KEYS, WEIGHTS as DRAFTER_WEIGHTS, check_weights, expected_shapes
from eagle3.drafter.model import DrafterConfig
from eagle3.errors import ConfigError, StageError
from eagle3.export.vllm_config import ARCHITECTURE, build_vllm_config, position_limit_problem, target_max_positions
from eagle3.extract.shards import INDEX
from eagle3.manifest import Manifest, committed_key
from eagle3.store import ObjectStore, local_copy
from eagle3.targets.aux_layers import to_sglang
from eagle3.vocab.mapping import load_vocab_mapping, validate_vocab_mapping

CONFIG = "config.json"
MODEL = "model.safetensors"
VOCAB_MAPPING = "vocab_mapping.safetensors"
SERVING = "SERVING.md"
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


def check_export(config: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]], aux_ids: list[int] | None) -> list[str]:
    """Problems with an export dir's config and tensors (name -> (shape, dtype)); empty when loadable."""
    problems = []
    if config.get("architectures") != [ARCHITECTURE]:
        problems.append(f"config architectures {config.get('architectures')} != [{ARCHITECTURE!r}]")
    try:
        dcfg = DrafterConfig.from_dict({**config, "aux_layer_ids": config.get("eagle_aux_hidden_state_layer_ids", [])})
    except (ConfigError, TypeError) as e:
        return problems + [f"config.json: {e}"]
    for key, want in {"model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False}.items():
        if config.get(key) != want:
            problems.append(f"config {key} = {config.get(key)!r}, expected {want!r}")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    inner = config.get("eagle_config") or {}
    if not inner.get("use_aux_hidden_state"):
        problems.append("eagle_config.use_aux_hidden_state must be true")
    if aux_ids is not None and ids != aux_ids:
        problems.append(f"eagle_aux_hidden_state_layer_ids {ids} != extract's {aux_ids}")
    if ids is not None and inner.get("eagle_aux_hidden_state_layer_ids") != to_sglang(ids):
        problems.append(f"eagle_config ids {inner.get('eagle_aux_hidden_state_layer_ids')} != to_sglang({ids})")
    shapes = {k: s for k, (s, _) in tensors.items()}
    problems += check_weights(dcfg, shapes, MODEL)
    for k in expected_shapes(dcfg):
        if k in tensors and tensors[k][1] != "bfloat16":
            problems.append(f"{MODEL}: {k} is {tensors[k][1]}, expected bfloat16")
    if tensors.get("d2t") != ((dcfg.draft_vocab_size,), "int64"):
        problems.append(f"{MODEL}: d2t is {tensors.get('d2t')}, expected ({dcfg.draft_vocab_size},) int64")
    if tensors.get("t2d") != ((dcfg.vocab_size,), "bool"):
        problems.append(f"{MODEL}: t2d is {tensors.get('t2d')}, expected ({dcfg.vocab_size},) bool")
    extra = set(tensors) - set(expected_shapes(dcfg)) - {"d2t", "t2d"}
    if extra:
        problems.append(f"{MODEL}: unexpected tensors {sorted(extra)}")
    return problems


_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "I64": "int64", "I32": "int32",
                       "BOOL": "bool", "U8": "uint8"}


def tensor_meta(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with safe_open(str(path), framework="pt") as f:
        out = {}
        for k in f.keys():
            sl = f.get_slice(k)
            out[k] = (tuple(sl.get_shape()), _SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype()))
        return out


def run(ctx: StageContext) -> dict[str, Any]:
    out = ctx.output
    if out is None:
        return {}
    try:
        dcfg = DrafterConfig.from_dict(ctx.upstream_json("train", DRAFTER_CONFIG))
    except ConfigError as e:
        raise StageError(f"train/{DRAFTER_CONFIG}: {e}") from None
    with safe_open(str(ctx.upstream_path("train", DRAFTER_WEIGHTS)), framework="pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    problems = check_weights(dcfg, {k: tuple(v.shape) for k, v in weights.items()}, f"train/{DRAFTER_WEIGHTS}")
    d2t, t2d = load_vocab_mapping(ctx.upstream_path("vocab", VOCAB_MAPPING))
    problems += [f"vocab/{VOCAB_MAPPING}: {p}" for p in validate_vocab_mapping(d2t, t2d, dcfg.vocab_size)]
    if d2t.numel() != dcfg.draft_vocab_size:
        problems.append(f"vocab mapping has {d2t.numel()} draft tokens, the drafter {dcfg.draft_vocab_size}")
    index = ctx.upstream_json("extract", INDEX)
    aux_ids = [int(i) for i in index["aux_layer_ids"]]
    if dcfg.aux_layer_ids != aux_ids:
        problems.append(f"drafter was configured with aux ids {dcfg.aux_layer_ids}, extract captured {aux_ids}")
    if dcfg.target_hidden_size != index["hidden_size"]:
        problems.append(f"drafter target_hidden_size {dcfg.target_hidden_size} != extract hidden_size {index['hidden_size']}")
    from eagle3.targets.load import load_target_config

    target_max = target_max_positions(load_target_config(ctx.cfg.target))
    limit = position_limit_problem(dcfg.max_position_embeddings, target_max,
                                   ctx.cfg.drafter.max_position_embeddings is not None)
    if limit:
        problems.append(limit)
    if problems:
        raise StageError(problems[0])

    config = build_vllm_config(dcfg, aux_ids)
    tensors = export_tensors(weights, d2t, t2d)
    path = ctx.scratch / MODEL
    save_file(tensors, str(path), metadata={"format": "pt"})
    out.put_json(CONFIG, config)
    out.put_file(MODEL, path)
    out.put_bytes(SERVING, serving_note(aux_ids).encode())
    return {
        "aux_layer_ids": aux_ids,
        "sglang_aux_layer_ids": to_sglang(aux_ids),
        "draft_vocab_size": dcfg.draft_vocab_size,
        "target_vocab_size": dcfg.vocab_size,
        "max_position_embeddings": dcfg.max_position_embeddings,
        "target_max_position_embeddings": target_max,
        "parameters": sum(t.numel() for k, t in tensors.items() if k not in ("d2t", "t2d")),
        "dtype": "bfloat16",
    }


def deep_check(store: ObjectStore, manifest: Manifest) -> list[str]:
    prefix = manifest.prefix
    try:
        config = json.loads(store.get_bytes(f"{prefix}/{CONFIG}"))
    except ValueError:
        return [f"export/{CONFIG} does not parse"]
    with local_copy(store, f"{prefix}/{MODEL}") as local:
        meta = tensor_meta(local)
    aux = None
    key = committed_key(store, manifest.run_id, "extract", INDEX)
    if key is not None:
        aux = json.loads(store.get_bytes(key)).get("aux_layer_ids")
    return check_export(config, meta, aux)
