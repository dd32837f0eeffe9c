"""The ``generate`` stage: prompts → target responses → tokenized samples + token frequencies.

Durability: finished requests are appended in parts (``parts/part-NNNNNN.jsonl``, each
journaled by :class:`eagle3.manifest.StageOutput`) of ``part_size`` records. A killed
run, rerun with the same input key, adopts the recovered parts and requests only the
sample ids they lack (failed requests are tried again), so nothing is lost or duplicated.
At the end the parts are merged into the contract's objects and dropped:
``raw_responses.jsonl``, ``tokenized.safetensors``, ``token_freq.safetensors``,
``metadata.json``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from safetensors.torch import load_file, save_file

from eagle3.context import StageContext
from eagle3.generate.client import ChatClient, ChatParams, CredentialsError, EndpointError, RetryPolicy, api_key_from_env
from eagle3.generate.prompts import Prompt, load_prompts
from eagle3.generate.samples import build_samples, merge_records, outcome_record, token_frequencies
from eagle3.generate.tokenized import TOKENIZED, read_tokenized, write_tokenized
from eagle3.errors import StageError
from eagle3.manifest import Manifest
from eagle3.store import ObjectStore, local_copy
from eagle3.targets.load import check_vocab, load_target_config, load_tokenizer, served_model_name

RAW = "raw_responses.jsonl"
TOKEN_FREQ = "token_freq.safetensors"
METADATA = "metadata.json"
PARTS = "parts/"


def part_name(index: int) -> str:
    return f"{PARTS}part-{index:06d}.jsonl"


def _jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records).encode()


def _read_jsonl(store: ObjectStore, key: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in store.get_bytes(key).splitlines() if line.strip()]


def recover_records(ctx: StageContext) -> tuple[list[dict[str, Any]], int]:
    """Records an interrupted attempt committed (adopting its parts), and the next part index."""
    assert ctx.output is not None
    records: list[dict[str, Any]] = []
    next_part = 0
    recovered = ctx.output.recovered()
    if RAW in recovered:  # a merge that finished before the attempt died
        records += _read_jsonl(ctx.store, f"{ctx.output.prefix}/{RAW}")
    for name in recovered:
        if name.startswith(PARTS):
            ctx.output.adopt(name)
            records += _read_jsonl(ctx.store, f"{ctx.output.prefix}/{name}")
            next_part = max(next_part, int(name[len(PARTS) + len("part-"):].split(".")[0]) + 1)
    return records, next_part


def _check_same_prompts(records: list[dict[str, Any]], prompts: dict[int, Prompt]) -> None:
    for rec in records:
        p = prompts.get(rec["id"])
        if p is None or p.messages != rec["messages"]:
            raise StageError(f"prompt {rec['id']} differs from the interrupted attempt's: the prompts input changed "
                             "under the same config; rerun with --force")


async def _generate(ctx: StageContext, todo: list[Prompt], params: ChatParams, next_part: int,
                    resumed: int, total: int) -> list[dict[str, Any]]:
    """Request every prompt in ``todo``; append finished records in durable parts."""
    assert ctx.output is not None and ctx.endpoint is not None
    g = ctx.cfg.generate
    by_id = {p.sample_id: p for p in todo}
    policy = RetryPolicy(max_retries=g.max_retries)
    records: list[dict[str, Any]] = []
    buffer: list[dict[str, Any]] = []
    failed = 0

    def flush() -> None:
        nonlocal next_part
        if buffer:
            ctx.output.put_bytes(part_name(next_part), _jsonl(buffer))
            next_part += 1
            buffer.clear()

    async with ChatClient(ctx.endpoint, api_key=api_key_from_env(), timeout_s=g.request_timeout_s,
                          concurrency=g.concurrency, policy=policy, seed=g.seed) as client:
        await _preflight(client, ctx.endpoint, params.model)
        t0 = time.monotonic()
        try:
            async for outcome in client.run(((p.sample_id, p.messages) for p in todo), params):
                rec = outcome_record(by_id[outcome.sample_id], outcome)
                failed += rec["error"] is not None
                records.append(rec)
                buffer.append(rec)
                if len(buffer) >= g.part_size:
                    flush()
                done = resumed + len(records)
                ctx.progress(done, total, "samples", failed=failed,
                             samples_per_s=round(len(records) / max(time.monotonic() - t0, 1e-9), 2))
        except CredentialsError as e:
            flush()
            raise StageError(f"endpoint {ctx.endpoint} rejected the credentials ({e}); set EAGLE3_API_KEY") from None
        flush()
    ctx.progress(resumed + len(records), total, "samples", force=True, failed=failed)
    return records


async def _preflight(client: ChatClient, endpoint: str, model: str) -> None:
    try:
        served = await client.list_models()
    except CredentialsError as e:
        raise StageError(f"endpoint {endpoint} rejected the credentials ({e}); set EAGLE3_API_KEY") from None
    except EndpointError as e:
        raise StageError(f"endpoint unreachable: {e}") from None
    if model not in served:
        raise StageError(f"endpoint {endpoint} serves {', '.join(served) or 'no models'}, not {model}; "
                         "set target.served_name to the served model name")


def request_extras(cfg: Any) -> dict[str, Any]:
    """Fields beyond OpenAI's that the request carries: vLLM's ``return_token_ids`` (vLLM 0.22.1
    ``entrypoints/openai/chat_completion/protocol.py``: ``choices[].token_ids``, ``prompt_token_ids``)."""
    wanted = cfg.generate.return_token_ids
    if wanted is None:  # auto serves with vLLM where it is installed (the serve image)
        from importlib.util import find_spec

        wanted = cfg.serve.engine == "vllm" or (cfg.serve.engine == "auto" and cfg.serve.endpoint is None
                                                and find_spec("vllm") is not None)
    return {"return_token_ids": True} if wanted else {}


def run(ctx: StageContext) -> dict[str, Any]:
    cfg, g = ctx.cfg, ctx.cfg.generate
    if ctx.output is None:
        raise StageError("generate runs on one process (rank 0) only")
    if not ctx.endpoint:
        raise StageError("generate needs an endpoint: pass --endpoint URL or set serve.endpoint (base URL ending in /v1)")
    tokenizer = load_tokenizer(cfg.target)
    vocab_size = check_vocab(cfg.target, tokenizer, load_target_config(cfg.target))
    prompts = load_prompts(g.prompts, g.system_prompt, g.max_samples, g.seed, cfg.store.endpoint_url, cfg.store.region)
    by_id = {p.sample_id: p for p in prompts}

    recovered, next_part = recover_records(ctx)
    _check_same_prompts(recovered, by_id)
    done = {r["id"] for r in recovered if r.get("error") is None}
    todo = [p for p in prompts if p.sample_id not in done]
    params = ChatParams(model=served_model_name(cfg.target), max_tokens=g.max_tokens, temperature=g.temperature,
                        top_p=g.top_p, seed=g.seed, extra=request_extras(cfg))
    t0 = time.monotonic()
    new = asyncio.run(_generate(ctx, todo, params, next_part, len(done), len(prompts))) if todo else []
    gen_s = time.monotonic() - t0

    merged = merge_records(recovered, new)
    records = [merged[p.sample_id] for p in prompts]
    if not any(r.get("error") is None for r in records):
        raise StageError(f"all {len(records)} requests to {ctx.endpoint} failed; first error: {records[0].get('error')}")
    data, stats = build_samples(records, tokenizer, g.max_length, g.drop_truncated, g.require_reasoning)
    counts = token_frequencies(data, vocab_size)

    ctx.output.put_bytes(RAW, _jsonl(records))
    tok_path, freq_path = ctx.scratch / TOKENIZED, ctx.scratch / TOKEN_FREQ
    write_tokenized(tok_path, data)
    ctx.output.put_file(TOKENIZED, tok_path)
    save_file({"counts": counts}, str(freq_path), metadata={"format": "eagle3.token_freq.v1"})
    ctx.output.put_file(TOKEN_FREQ, freq_path)
    usage = [r.get("usage") or {} for r in records if r.get("error") is None]
    metadata = {
        **stats.as_dict(),
        "resumed": len(done),
        "generated_this_attempt": len(new),
        "generation_s": round(gen_s, 3),
        "samples_per_s": round(len(new) / gen_s, 3) if new and gen_s > 0 else 0.0,
        "prompt_tokens": sum(int(u.get("prompt_tokens") or 0) for u in usage),
        "completion_tokens": sum(int(u.get("completion_tokens") or 0) for u in usage),
        "target_vocab_size": vocab_size,
        "tokenizer_size": len(tokenizer),
        "model": params.model,
        "prompts": g.prompts,
    }
    ctx.output.put_json(METADATA, metadata)
    for name in [n for n in ctx.output.entries if n.startswith(PARTS)]:
        ctx.output.drop(name)
    for key in ctx.store.list(f"{ctx.output.prefix}/{PARTS}"):
        ctx.store.delete(key)  # a part written but not journaled when an earlier attempt died
    return metadata


def deep_check(store: ObjectStore, manifest: Manifest) -> list[str]:
    """Content checks: JSONL parses, counts agree, token ids < vocab, frequencies match the masks."""
    prefix = manifest.prefix
    problems: list[str] = []
    try:
        meta = json.loads(store.get_bytes(f"{prefix}/{METADATA}"))
        records = _read_jsonl(store, f"{prefix}/{RAW}")
    except ValueError as e:
        return [f"{prefix}: metadata.json or {RAW} does not parse: {e}"]
    vocab = int(meta.get("target_vocab_size", 0))
    kept_ids = sorted(r["id"] for r in records if r.get("excluded") is None)
    if len(records) != meta.get("requested"):
        problems.append(f"{prefix}/{RAW} has {len(records)} records, metadata says {meta.get('requested')} requested")
    if len({r["id"] for r in records}) != len(records):
        problems.append(f"{prefix}/{RAW} repeats sample ids")
    with local_copy(store, f"{prefix}/{TOKENIZED}") as path:
        data = read_tokenized(path)
    problems += [f"{prefix}/{TOKENIZED}: {p}" for p in data.validate(vocab)]
    if sorted(data.sample_ids.tolist()) != kept_ids or len(data) != meta.get("kept"):
        problems.append(f"{prefix}/{TOKENIZED} holds {len(data)} samples; {RAW} keeps {len(kept_ids)}, "
                        f"metadata says {meta.get('kept')}")
    with local_copy(store, f"{prefix}/{TOKEN_FREQ}") as path:
        counts = load_file(str(path)).get("counts")
    if counts is None or counts.numel() != vocab:
        problems.append(f"{prefix}/{TOKEN_FREQ}: counts length {None if counts is None else counts.numel()} != "
                        f"target vocab size {vocab}")
    elif int(counts.sum()) != int(data.loss_mask.sum()):
        problems.append(f"{prefix}/{TOKEN_FREQ}: counts sum {int(counts.sum())} != loss-masked tokens "
                        f"{int(data.loss_mask.sum())}")
    return problems

