"""The export stage: the trained drafter as a directory vLLM and SGLang load.

``config.json`` (see :mod:`eagle3.export.vllm_config`) + ``model.safetensors`` holding
the drafter under the names vLLM's ``llama_eagle3.py`` maps (``fc.weight``,
``midlayer.*`` -> ``layers.0.*``, ``norm.weight``, ``lm_head.weight``), ``d2t`` (loaded as
``draft_id_to_target_id``) and ``t2d`` (skipped by vLLM, kept for SGLang and tools) when the
draft vocab is smaller than the target's, and ``SERVING.md`` (the commands, the target dtype,
the trained draft depth), written by :func:`eagle3.export.directory.write_checked_export`
after its own checks. No ``embed_tokens``: both engines share the target's embedding when it
is absent. The aux ids come from extract's index (what the drafter was trained on) and must
agree with the drafter config; SGLang's copy is converted by the target's family rule, and ids
that rule cannot express are refused unless ``export.sglang`` is false; the drafter's position
limit must not cut drafting short of the target's (checked here: it needs the target's config).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from eagle3.context import StageContext
from eagle3.drafter.adapter import CONFIG as DRAFTER_CONFIG
from eagle3.drafter.adapter import WEIGHTS as DRAFTER_WEIGHTS, check_weights, expected_shapes
from eagle3.drafter.model import DrafterConfig
from eagle3.errors import ConfigError, StageError
from eagle3.export.directory import (CONFIG, FILES, MODEL, ServingFacts, export_problems, sglang_problem,
                                     write_checked_export)
from eagle3.export.vllm_config import ARCHITECTURE, position_limit_problem, target_max_positions
from eagle3.extract.shards import INDEX
from eagle3.manifest import Manifest, committed_key
from eagle3.store import ObjectStore, local_copy
from eagle3.targets.aux_layers import FAMILIES, Family, sglang_captures
from eagle3.vocab.mapping import load_vocab_mapping

VOCAB_MAPPING = "vocab_mapping.safetensors"


def check_export(config: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]], aux_ids: list[int] | None,
                 family: Family | None = None) -> list[str]:
    """Problems with an export dir's config and tensors (name -> (shape, dtype)); empty when loadable.
    ``family``: the target's, when the export is for SGLang too (its ``eagle_config`` ids are checked)."""
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
    inner_ids = inner.get("eagle_aux_hidden_state_layer_ids")
    if family is not None and ids is not None:
        captured = sglang_captures(inner_ids, family) if inner_ids is not None else None
        if captured != ids:
            problems.append(f"eagle_config ids {inner_ids} make SGLang capture {captured} on a {family.name}-family "
                            f"target, not {ids}")
    shapes = {k: s for k, (s, _) in tensors.items()}
    problems += check_weights(dcfg, shapes, MODEL)
    for k in expected_shapes(dcfg):
        if k in tensors and tensors[k][1] != "bfloat16":
            problems.append(f"{MODEL}: {k} is {tensors[k][1]}, expected bfloat16")
    problems += _mapping_problems(dcfg, tensors)
    extra = set(tensors) - set(expected_shapes(dcfg)) - {"d2t", "t2d"}
    if extra:
        problems.append(f"{MODEL}: unexpected tensors {sorted(extra)}")
    return problems


def _mapping_problems(dcfg: DrafterConfig, tensors: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
    if dcfg.draft_vocab_size == dcfg.vocab_size:  # vLLM 0.30+ refuses a d2t then
        present = sorted({"d2t", "t2d"} & set(tensors))
        return [f"{MODEL}: {', '.join(present)} in a full-vocab export (vLLM refuses them)"] if present else []
    problems = []
    if tensors.get("d2t") != ((dcfg.draft_vocab_size,), "int64"):
        problems.append(f"{MODEL}: d2t is {tensors.get('d2t')}, expected ({dcfg.draft_vocab_size},) int64")
    if tensors.get("t2d") != ((dcfg.vocab_size,), "bool"):
        problems.append(f"{MODEL}: t2d is {tensors.get('t2d')}, expected ({dcfg.vocab_size},) bool")
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


def serving_facts(cfg: Any, index: dict[str, Any], target_config: Any | None = None) -> ServingFacts:
    """What a run's exports say about serving (the export stage's, and any drafter exported along
    the way): the target's family where SGLang is served too, the dtype extract recorded in its
    ``index``, the draft depth trained to."""
    from eagle3.targets.aux_layers import target_family
    from eagle3.targets.load import load_target_config, target_dtype

    target_config = target_config if target_config is not None else load_target_config(cfg.target)
    family = target_family(target_config) if cfg.export.sglang else None
    dtype = index.get("target_dtype") or target_dtype(cfg.target, "cuda", target_config)
    return ServingFacts(family, dtype, cfg.train.ttt_steps)


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
    d2t, t2d = load_vocab_mapping(ctx.upstream_path("vocab", VOCAB_MAPPING))
    index = ctx.upstream_json("extract", INDEX)
    aux_ids = [int(i) for i in index["aux_layer_ids"]]
    problems = export_problems(dcfg, weights, d2t, t2d, aux_ids, f"train/{DRAFTER_WEIGHTS}", f"vocab/{VOCAB_MAPPING}")
    if dcfg.target_hidden_size != index["hidden_size"]:
        problems.append(f"drafter target_hidden_size {dcfg.target_hidden_size} != extract hidden_size {index['hidden_size']}")
    from eagle3.targets.load import load_target_config

    target_config = load_target_config(ctx.cfg.target)
    facts = serving_facts(ctx.cfg, index, target_config)
    if ctx.cfg.export.sglang:
        what = f"a {getattr(target_config, 'model_type', None)} target"
        problems += [p for p in [sglang_problem(aux_ids, facts.family, what)] if p]
    target_max = target_max_positions(target_config)
    limit = position_limit_problem(dcfg.max_position_embeddings, target_max,
                                   ctx.cfg.drafter.max_position_embeddings is not None)
    if limit:
        problems.append(limit)
    if problems:
        raise StageError(problems[0])
    export_dir = ctx.scratch / "export"
    stats = write_checked_export(export_dir, dcfg, weights, d2t, t2d, aux_ids, facts)
    for name in FILES:
        out.put_file(name, export_dir / name)
    return {**stats, "target_max_position_embeddings": target_max}


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
    family = next((f for f in FAMILIES if f.name == manifest.stats.get("target_family")), None)
    return check_export(config, meta, aux, family)
