"""The extract stage: aux + final hidden states of the target over the tokenized samples.

Shards stream to the store as they are made: shard k goes from host memory straight
into the store (hashed on the way) on a background thread while shard k+1 is extracted
(host memory: two shards per process; no local disk). Shard boundaries are a pure
function of sample lengths and ``shard_tokens``, so a rerun with the same input key
adopts the shards a killed attempt finished and computes only the rest: no sample is
lost or written twice. Under torchrun the shards left are dealt to the ranks
(:mod:`eagle3.extract.parallel`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from eagle3.context import StageContext
from eagle3.errors import StageError
from eagle3.extract.batching import ShardPlan, plan_shards
from eagle3.extract.parallel import Ranks, my_share
from eagle3.extract.run import HostStaging, ShardStats, extract_shard
from eagle3.extract.shards import INDEX, SHARD_DIR, STORAGE_DTYPES, TARGET_HEAD, read_shard, shard_name
from eagle3.extract.writer import ShardWriter
from eagle3.generate.tokenized import TOKENIZED, read_tokenized
from eagle3.manifest import Manifest, ObjectEntry, ObjectWriter, StageOutput, committed_key
from eagle3.store import ObjectStore, local_copy
from eagle3.targets.aux_layers import resolve_aux_layer_ids
from eagle3.targets.capture import HiddenCapture, find_decoder_stack
from eagle3.targets.placement import load_target, resolve_device
from eagle3.vllm_version import require_vllm


def aux_ids_for(target_settings: Any, num_layers: int) -> list[int]:
    try:
        return resolve_aux_layer_ids(target_settings.aux_layer_ids, num_layers)
    except ValueError as e:
        raise StageError(f"target.aux_layer_ids: {e}") from None


def bytes_per_token(hidden_size: int, storage_dtype: str) -> int:
    """Hidden-state bytes one token costs in a shard (aux 3H + final H, plus fp8 scales)."""
    if storage_dtype == "float8_e4m3fn":
        return 4 * hidden_size + 4 * 4
    return 4 * hidden_size * STORAGE_DTYPES[storage_dtype].itemsize


def target_head(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """embed_tokens + lm_head in the target's dtype, so train never loads the full target."""
    embed = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    # clone: tied weights share storage, which safetensors refuses to save twice.
    return {"embed_tokens.weight": embed.cpu().clone(), "lm_head.weight": head.cpu().clone()}


@dataclass(frozen=True)
class TargetShape:
    """What extract needs of the target's config."""

    config: Any
    num_layers: int
    vocab_size: int
    hidden_size: int
    aux_ids: list[int]


@dataclass(frozen=True)
class Totals:
    """Every rank's extraction, summed (the slowest rank's wall time)."""

    real_tokens: int
    padded_tokens: int
    batches_s: float
    wall_s: float


def run(ctx: StageContext) -> dict[str, Any]:
    from eagle3.targets.load import resolve_target
    from eagle3.targets.placement import needs_device_map

    settings, tset = ctx.cfg.extract, ctx.cfg.target
    vllm_version, ranks = _start(ctx)
    writer = ctx.object_writer()
    data = read_tokenized(ctx.upstream_path("generate", TOKENIZED))
    target = _target_shape(tset, data)
    plans = plan_shards(data.lengths(), settings.shard_tokens)
    todo_all, head_done = _work_left(ctx, plans, ranks)
    device = ranks.device(resolve_device(settings.device))
    fits = not needs_device_map(resolve_target(tset), device)
    todo = my_share(todo_all, ranks.gather(fits or ranks.local_rank == 0), ranks.rank)
    stats = ShardStats()
    wall = 0.0
    if vllm_version is not None:
        wall = _extract_vllm(ctx, data, todo, target.aux_ids, target.hidden_size, head_done, target.config, writer,
                             stats, vllm_version)
    elif todo or (ctx.output is not None and not head_done):
        wall = _extract_hf(ctx, data, todo, target, head_done, device, writer, stats)
    totals = _gather(ranks, writer, ctx.output, todo, stats, wall)
    if totals is None:
        return {}  # only rank 0 writes the index and commits
    index = _write_index(ctx, data, plans, target, device)
    padding = 1 - totals.real_tokens / totals.padded_tokens if totals.padded_tokens else 0.0
    return {
        "aux_layer_ids": target.aux_ids,
        "engine": settings.engine,
        "target_dtype": index["target_dtype"],
        "storage_dtype": settings.storage_dtype,
        "hidden_bytes_per_token": bytes_per_token(target.hidden_size, settings.storage_dtype),
        "samples": len(data),
        "tokens": data.num_tokens,
        "shards": len(plans),
        "shards_adopted": len(plans) - len(todo_all),
        "tokens_extracted": totals.real_tokens,
        "processes": ranks.world,
        "batches_s": round(totals.batches_s, 3),
        "extract_wall_s": round(totals.wall_s, 3),
        "tokens_per_s": round(totals.real_tokens / totals.wall_s, 1) if totals.wall_s else None,
        "padding_ratio": round(padding, 4),
    }


def _start(ctx: StageContext) -> tuple[tuple[int, int, int] | None, Ranks]:
    """The vLLM version (engine vllm), the fit check, and the ranks joined."""
    from eagle3.targets.fit import check_fit

    settings = ctx.cfg.extract
    vllm_version = require_vllm("extract.engine=vllm") if settings.engine == "vllm" else None
    check_fit(ctx.cfg, "extract")
    ranks = Ranks.from_env()
    if settings.engine == "vllm" and ranks.world > 1:
        raise StageError("extract.engine=vllm runs one process (vLLM spreads the target over the GPUs itself); "
                         "set extract.nproc_per_node: 1")
    ranks.join()
    return vllm_version, ranks


def _target_shape(tset: Any, data: Any) -> TargetShape:
    """The target's shape from its config; the samples must hold tokens, each within its vocab."""
    from eagle3.targets.load import hidden_size, load_target_config, num_layers, target_vocab_size

    if len(data) == 0:
        raise StageError("generate produced no tokenized samples: nothing to extract")
    config = load_target_config(tset)
    n_layers, vocab = num_layers(config), target_vocab_size(config)
    target = TargetShape(config, n_layers, vocab, hidden_size(config), aux_ids_for(tset, n_layers))
    problems = data.validate(vocab)
    if problems:
        raise StageError(f"generate/{TOKENIZED}: {problems[0]}")
    return target


def _work_left(ctx: StageContext, plans: list[ShardPlan], ranks: Ranks) -> tuple[list[ShardPlan], bool]:
    """The shards no earlier attempt finished, and whether its target head is there: rank 0 adopts
    what a killed attempt journaled and tells the others (who write only after it began the attempt)."""
    out = ctx.output
    left: tuple[list[int], bool] | None = None
    if out is not None:
        recovered = out.recovered(SHARD_DIR + "/")
        for p in plans:
            if shard_name(p.index) in recovered:
                out.adopt(shard_name(p.index))
        head_done = TARGET_HEAD in out.recovered(TARGET_HEAD)
        if head_done:
            out.adopt(TARGET_HEAD)
        left = ([p.index for p in plans if shard_name(p.index) not in recovered], head_done)
    todo_ids, head_done = ranks.broadcast(left)
    by_index = {p.index: p for p in plans}
    return [by_index[i] for i in todo_ids], head_done


def _extract_hf(ctx: StageContext, data: Any, todo: list[ShardPlan], target: TargetShape, head_done: bool,
                device: torch.device, writer: ObjectWriter, stats: ShardStats) -> float:
    """The shards left, through the target loaded with transformers (rank 0 also saves its head)."""
    settings, out = ctx.cfg.extract, ctx.output
    model = load_target(ctx.cfg.target, device)
    if out is not None and not head_done:
        path = ctx.scratch / TARGET_HEAD
        from safetensors.torch import save_file

        save_file(target_head(model), str(path))
        out.put_file(TARGET_HEAD, path)
        path.unlink()
    stack = find_decoder_stack(model, target.num_layers)
    staging = HostStaging()
    with HiddenCapture(stack, target.aux_ids) as capture:
        return _write_shards(ctx, writer, todo, stats, lambda p: extract_shard(
            capture, data, p, target.hidden_size, settings.batch_tokens, settings.storage_dtype, stats, staging))


def _write_shards(ctx: StageContext, writer: ObjectWriter, todo: list[ShardPlan], stats: ShardStats,
                  extract: Callable[[ShardPlan], Any]) -> float:
    """Each shard left, extracted and streamed to the store while the next is extracted, with
    progress; the seconds it took."""
    total, done, t0 = sum(p.num_tokens for p in todo), 0, time.perf_counter()
    with ShardWriter(writer) as shards:
        for p in todo:
            shard = extract(p)
            shards.submit(p.index, shard)
            del shard
            done += p.num_tokens
            ctx.progress(done, total, "tokens", shard=p.index,
                         tokens_per_s=round(stats.real_tokens / max(time.perf_counter() - t0, 1e-9), 1))
    return time.perf_counter() - t0


def _gather(ranks: Ranks, writer: ObjectWriter, out: StageOutput | None, todo: list[ShardPlan], stats: ShardStats,
            wall: float) -> Totals | None:
    """Every rank's shards into rank 0's manifest (``out``), and their counts summed; the ranks'
    last collective. None on the other ranks."""
    mine = [writer.entries[shard_name(p.index)].model_dump() for p in todo]
    reports = ranks.gather((mine, stats.real_tokens, stats.padded_tokens, stats.batches_s, wall))
    ranks.leave()  # the last collective: rank 0 goes on to commit alone
    if out is None:
        return None
    for entries, *_ in reports[1:]:
        for e in entries:
            out.include(ObjectEntry.model_validate(e))
    return Totals(sum(r[1] for r in reports), sum(r[2] for r in reports), sum(r[3] for r in reports),
                  max(r[4] for r in reports))


def _write_index(ctx: StageContext, data: Any, plans: list[ShardPlan], target: TargetShape, device: torch.device) -> dict:
    """``index.json``: how the shards were made and what each holds."""
    from eagle3.targets.load import target_dtype

    settings, tset, out = ctx.cfg.extract, ctx.cfg.target, ctx.output
    assert out is not None
    index = {
        "format": "eagle3.hidden.v1",
        "target_model": tset.model,
        "aux_layer_ids": target.aux_ids,
        "final_hidden": "after_final_norm",
        "target_dtype": target_dtype(tset, "cuda" if settings.engine == "vllm" else device.type, target.config),
        "hidden_size": target.hidden_size,
        "num_layers": target.num_layers,
        "target_vocab_size": target.vocab_size,
        "storage_dtype": settings.storage_dtype,
        "engine": settings.engine,
        "num_samples": len(data),
        "num_tokens": data.num_tokens,
        "shards": [{"name": shard_name(p.index), "num_samples": p.end - p.first, "num_tokens": p.num_tokens}
                   for p in plans],
    }
    out.put_json(INDEX, index, journal=False)
    return index


def _extract_vllm(ctx: StageContext, data: Any, todo: list, aux_ids: list[int], hidden: int, head_done: bool,
                  config: Any, writer: ObjectWriter, stats: ShardStats, vllm_version: tuple[int, int, int]) -> float:
    """The shards left, through the target in vLLM; the target head read from the checkpoint."""
    from safetensors.torch import save_file

    from eagle3.extract import vllm_engine
    from eagle3.targets.checkpoint import checkpoint_dir, target_head_tensors
    from eagle3.targets.load import resolve_target

    out, settings = ctx.output, ctx.cfg.extract
    assert out is not None
    source = resolve_target(ctx.cfg.target)
    if not head_done:
        root = checkpoint_dir(source, ctx.cfg.target.cache_dir)
        path = ctx.scratch / TARGET_HEAD
        save_file(target_head_tensors(root, bool(getattr(config, "tie_word_embeddings", False))), str(path))
        out.put_file(TARGET_HEAD, path)
        path.unlink()
    if not todo:
        return 0.0
    longest = int(data.lengths().max())
    extractor = vllm_engine.open_llm(ctx.cfg, source, config, aux_ids, longest + 1, vllm_version)
    return _write_shards(ctx, writer, todo, stats, lambda p: vllm_engine.extract_shard_vllm(
        extractor, data, p, hidden, settings.storage_dtype, stats))


def deep_check(store: ObjectStore, manifest: Manifest) -> list[str]:
    """Every shard's tensors agree; the index covers generate's samples; aux ids resolve."""
    prefix = manifest.prefix
    problems: list[str] = []
    try:
        index = json.loads(store.get_bytes(f"{prefix}/{INDEX}"))
    except ValueError:
        return [f"extract/{INDEX} does not parse"]
    hidden = index.get("hidden_size")
    seen: set[int] = set()
    tokens = samples = 0
    for entry in index.get("shards", []):
        name = entry["name"]
        if name not in manifest.keys(SHARD_DIR + "/"):
            problems.append(f"index lists {name}, the manifest does not")
            continue
        with local_copy(store, f"{prefix}/{name}") as local:
            shard = read_shard(local)
        problems += [f"{name}: {p}" for p in shard.validate(hidden)]
        if shard.num_tokens != entry["num_tokens"] or shard.num_samples != entry["num_samples"]:
            problems.append(f"{name}: holds {shard.num_samples} samples / {shard.num_tokens} tokens, index says "
                            f"{entry['num_samples']} / {entry['num_tokens']}")
        if shard.storage_dtype != index.get("storage_dtype"):
            problems.append(f"{name}: stored as {shard.storage_dtype}, index says {index.get('storage_dtype')}")
        dup = seen.intersection(shard.sample_ids.tolist())
        if dup:
            problems.append(f"{name}: sample ids {sorted(dup)[:5]} appear in an earlier shard")
        seen.update(shard.sample_ids.tolist())
        tokens += shard.num_tokens
        samples += shard.num_samples
    if tokens != index.get("num_tokens") or samples != index.get("num_samples"):
        problems.append(f"shards hold {samples} samples / {tokens} tokens, index says "
                        f"{index.get('num_samples')} / {index.get('num_tokens')}")
    gen = _generate_samples(store, manifest)
    if gen is not None and gen != samples:
        problems.append(f"shards hold {samples} samples, generate committed {gen}")
    layers, ids = index.get("num_layers"), index.get("aux_layer_ids")
    if layers is not None and ids is not None:
        try:
            if ids != resolve_aux_layer_ids(ids, layers):
                problems.append(f"aux_layer_ids {ids} do not resolve for {layers} layers")
        except ValueError as e:
            problems.append(f"aux_layer_ids: {e}")
    if manifest.stats.get("aux_layer_ids") != ids:
        problems.append(f"manifest stats aux_layer_ids {manifest.stats.get('aux_layer_ids')} != index {ids}")
    return problems


def _generate_samples(store: ObjectStore, manifest: Manifest) -> int | None:
    """Sample count of the generate stage this extract read (its tokenized file)."""
    from eagle3.manifest import read_manifest

    gen = read_manifest(store, manifest.run_id, "generate")
    key = committed_key(store, manifest.run_id, "generate", TOKENIZED)
    if gen is None or key is None:
        return None
    local = store.local_path(key)
    if local is None or not local.exists():
        return gen.manifest.stats.get("samples")
    from safetensors import safe_open

    with safe_open(str(local), framework="pt") as f:
        return int(f.get_slice("sample_ids").get_shape()[0])
