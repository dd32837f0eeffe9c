"""The evaluate stage: acceptance length of the exported drafter on held-out prompts.

engine ``hf``: offline greedy speculative decoding with the HF target verifying chains of
``num_draft_tokens`` drafts (:mod:`eagle3.evaluate.spec_decode`); the first
``check_greedy`` prompts are also decoded plainly and must give identical tokens. With
``workers`` above 1, that many processes (:mod:`eagle3.evaluate.workers`) decode a share
of the prompts each; with ``batch_size`` above 1, each process decodes its prompts
``batch_size`` at a time in lockstep (:mod:`eagle3.evaluate.batched`). The report is the
same either way, assembled in prompt order. Each prompt's result is journaled as it
arrives (``prompts/prompt-NNNNNN.json``), so a rerun after a kill decodes only the prompts
left and gives the same report.
engine ``vllm``: the export served by vLLM, acceptance read from vLLM's own metrics.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from eagle3.context import StageContext
from eagle3.errors import StageError
from eagle3.settings.evaluate import EvaluateSettings
from eagle3.evaluate.prompts import held_out_prompts
from eagle3.evaluate.report import plot_acceptance, summarize, summarize_counts
from eagle3.export.directory import read_d2t
from eagle3.export.stage import CONFIG as EXPORT_CONFIG
from eagle3.export.stage import MODEL as EXPORT_MODEL
from eagle3.export.vllm_config import drafter_config_from_export
from eagle3.manifest import Manifest
from eagle3.store import ObjectStore
from eagle3.settings.target import TargetSettings
from eagle3.vllm_version import require_vllm

REPORT = "report.json"
PLOT = "acceptance.png"
PROMPT_DIR = "prompts"


def prompt_key(index: int) -> str:
    return f"{PROMPT_DIR}/prompt-{index:06d}.json"


def _eos_ids(tokenizer: Any, model: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def held_out_prompt_ids(cfg: Any) -> tuple[Any, list[list[int]]]:
    """The held-out prompts, and their token ids as a server prompts the target: the chat
    template with its generation prompt (:mod:`eagle3.generate.render`, as generate's samples)."""
    from eagle3.generate.render import encode, generation_prompt
    from eagle3.targets.load import load_tokenizer

    held = held_out_prompts(cfg)
    tokenizer = load_tokenizer(cfg.target)
    return held, [encode(tokenizer, generation_prompt(tokenizer, p.messages)) for p in held.prompts]


@dataclass
class PromptResult:
    """One prompt's decode: its report row and the counts the report sums over prompts."""

    row: dict[str, Any]  # the report's per_prompt entry
    accept_lengths: list[int]  # per verify step: accepted drafts + 1
    accepted_at: list[int]  # [k]: steps whose draft i was accepted
    tokens_generated: int


# decode(positions, [(prompt index, sample id, prompt token ids), ...]) -> one result per item
Decode = Callable[[list[int], list[tuple[int, int, list[int]]]], list[PromptResult]]


@contextmanager
def open_hf_decoder(target_settings: TargetSettings, ev: EvaluateSettings, export_config: dict[str, Any],
                    weights: Path) -> Iterator[Decode]:
    """Load target + drafter on ``ev.device``; yield ``decode(positions, [(index, sample_id, prompt), ...])``.

    ``index`` is the prompt's place among all held-out prompts (a resumed run decodes a
    subset; ``positions`` are places in that subset and are not used here).
    Opened once per decoding process (this one, or each worker of :mod:`eagle3.evaluate.workers`).
    A batch of more than one prompt is decoded in lockstep by the batched decoder (exactly what
    one at a time gives; a target it cannot mask is decoded one at a time, said once on stderr).
    The first ``ev.check_greedy`` prompts by index are also decoded plainly and compared.
    """
    from eagle3.drafter.adapter import load_drafter
    from eagle3.evaluate.batched import BatchedSpeculativeDecoder
    from eagle3.evaluate.spec_decode import DecodeResult, SpeculativeDecoder, greedy_generate
    from eagle3.targets.capture import HiddenCapture, find_decoder_stack
    from eagle3.targets.placement import load_target, resolve_device
    from eagle3.targets.load import load_tokenizer, num_layers

    dcfg = drafter_config_from_export(export_config)
    d2t = read_d2t(weights, dcfg.draft_vocab_size)
    target = load_target(target_settings, resolve_device(ev.device))
    embed = target.get_input_embeddings().weight
    drafter = load_drafter(weights, embed, dcfg).to(device=embed.device, dtype=embed.dtype).eval()
    eos = _eos_ids(load_tokenizer(target_settings), target)
    stack = find_decoder_stack(target, num_layers(target.config))
    with HiddenCapture(stack, dcfg.aux_layer_ids) as capture:
        decoder = SpeculativeDecoder(target, capture, drafter, d2t, ev.num_draft_tokens, eos)
        batched = (BatchedSpeculativeDecoder(target, capture, drafter, d2t, ev.num_draft_tokens, eos)
                   if ev.batch_size > 1 else None)
        if batched is not None and batched.fallback_reason:
            print(f"evaluate: batch_size={ev.batch_size}, but prompts are decoded one at a time: "
                  f"{batched.fallback_reason}", file=sys.stderr, flush=True)

        def result(index: int, sid: int, prompt: list[int], r: DecodeResult) -> PromptResult:
            row: dict[str, Any] = {"id": sid, "prompt_tokens": len(prompt), "tokens_generated": len(r.tokens),
                                   "verify_steps": r.steps,
                                   "mean_acceptance_length": round(sum(r.accept_lengths) / r.steps, 4) if r.steps else None}
            if index < ev.check_greedy:
                row["matches_greedy"] = r.tokens == greedy_generate(target, prompt, ev.max_new_tokens, eos)
            return PromptResult(row, r.accept_lengths, r.accepted_at, len(r.tokens))

        def decode(positions: list[int], items: list[tuple[int, int, list[int]]]) -> list[PromptResult]:
            prompts = [prompt for _, _, prompt in items]
            decoded = ([decoder.generate(prompts[0], ev.max_new_tokens)] if batched is None or len(items) == 1
                       else batched.generate_batch(prompts, ev.max_new_tokens))
            return [result(i, sid, prompt, r) for (i, sid, prompt), r in zip(items, decoded)]

        yield decode


def hf_report(k: int, results: list[PromptResult]) -> dict[str, Any]:
    """The report of per-prompt results, in prompt order."""
    lengths = [a for r in results for a in r.accept_lengths]
    accepted_at = [sum(r.accepted_at[j] for r in results) for j in range(k)]
    report = summarize(k, lengths, accepted_at, sum(r.tokens_generated for r in results))
    checked = [r.row["matches_greedy"] for r in results if "matches_greedy" in r.row]
    report["greedy_check"] = {"prompts_checked": len(checked), "prompts_matching": sum(checked),
                              "all_match": sum(checked) == len(checked)}
    report["per_prompt"] = [r.row for r in results]
    return report


def _check_workers_fit(ev: EvaluateSettings, target_settings: TargetSettings, workers: int) -> None:
    from eagle3.targets.placement import needs_device_map, resolve_device
    from eagle3.targets.load import resolve_target

    device = resolve_device(ev.device)  # fail here, in one line, not in every worker
    if workers > 1 and needs_device_map(resolve_target(target_settings), device):
        raise StageError(f"evaluate.workers={ev.workers} needs the target on one GPU, but it must be spread "
                         "over all GPUs; set evaluate.workers to 1")


def decode_prompts(target_settings: TargetSettings, ev: EvaluateSettings, export_config: dict[str, Any],
                   weights: Path, items: list[tuple[int, int, list[int]]],
                   labels: list[int] | None = None) -> Iterator[tuple[int, PromptResult]]:
    """``(position in items, result)`` as prompts finish, decoded by the exported drafter
    (``export_config`` + ``weights``) in this process or in ``ev.workers`` processes; close it
    (``contextlib.closing``) to stop the workers early."""
    from eagle3.evaluate.workers import batches, decode_here, decode_in_workers

    args = (target_settings, ev, export_config, weights)
    workers = min(ev.workers, len(batches(len(items), ev.batch_size)))
    _check_workers_fit(ev, target_settings, workers)
    if workers > 1:
        return decode_in_workers(open_hf_decoder, args, items, workers, batch_size=ev.batch_size, labels=labels)
    return decode_here(open_hf_decoder, args, items, ev.batch_size)


def _recovered_results(ctx: StageContext, sample_ids: list[int]) -> list[PromptResult | None]:
    """Results a killed attempt journaled (same input key), by prompt index; None where missing."""
    out = ctx.output
    results: list[PromptResult | None] = [None] * len(sample_ids)
    if out is None:
        return results
    for i, sid in enumerate(sample_ids):
        data = out.read_recovered(prompt_key(i))
        if data is None:
            continue
        try:
            r = PromptResult(**json.loads(data))
        except (ValueError, TypeError):
            continue  # unreadable: decoded again and overwritten
        if r.row.get("id") == sid:
            results[i] = r
    return results


def _evaluate_hf(ctx: StageContext, prompts: list[list[int]], sample_ids: list[int]) -> tuple[dict[str, Any], int]:
    """The report, and how many prompts' results a killed attempt had already journaled."""
    ev, out = ctx.cfg.evaluate, ctx.output
    assert out is not None
    config = ctx.upstream_json("export", EXPORT_CONFIG)
    results = _recovered_results(ctx, sample_ids)
    resumed = sum(r is not None for r in results)
    items = [(i, sample_ids[i], prompts[i]) for i, r in enumerate(results) if r is None]
    t0 = time.perf_counter()  # loading included: each worker loads its own target + drafter
    length_sum = sum(sum(r.accept_lengths) for r in results if r is not None)
    steps = sum(len(r.accept_lengths) for r in results if r is not None)
    if items:
        labels = [i for i, _, _ in items]  # failures name the prompt, not its place among those left
        stream = decode_prompts(ctx.cfg.target, ev, config, ctx.upstream_path("export", EXPORT_MODEL), items, labels)
        with closing(stream):
            for done, (j, r) in enumerate(stream, resumed + 1):
                i = items[j][0]
                out.put_json(prompt_key(i), asdict(r))  # journaled: a rerun keeps it
                results[i] = r
                length_sum, steps = length_sum + sum(r.accept_lengths), steps + len(r.accept_lengths)
                ctx.progress(done, len(prompts), "prompts", mean_acceptance_length=round(length_sum / max(steps, 1), 3))
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:  # the worker machinery counts results, so this is a bug, said plainly
        raise StageError(f"evaluate: no result for prompts {missing}")
    report = hf_report(ev.num_draft_tokens, results)  # type: ignore[arg-type]
    report["decode_s"] = round(time.perf_counter() - t0, 3)
    report["aux_layer_ids"] = drafter_config_from_export(config).aux_layer_ids
    return report, resumed


def _evaluate_vllm(ctx: StageContext, prompts: list[list[int]]) -> dict[str, Any]:
    from eagle3.evaluate.vllm_engine import run_vllm
    from eagle3.targets.load import resolve_target, target_dtype

    ev = ctx.cfg.evaluate
    export_dir = ctx.upstream_path("export", EXPORT_CONFIG).parent
    ctx.upstream_path("export", EXPORT_MODEL)  # both files side by side in export_dir
    counts = run_vllm(resolve_target(ctx.cfg.target), export_dir, prompts, ev.num_draft_tokens, ev.max_new_tokens,
                      ctx.cfg.target.trust_remote_code, target_dtype(ctx.cfg.target, "cuda"), ev.vllm)
    report = summarize_counts(ev.num_draft_tokens, counts["drafts"], counts["draft_tokens"], counts["accepted"],
                              counts["accepted_per_position"], counts["tokens_generated"])
    report["greedy_check"] = None  # vLLM verifies; there is no plain run to compare with here
    return report


def _engine_dtype(cfg: Any) -> str:
    """The dtype the target ran in: vLLM's on a GPU, the ``hf`` engine's on its device."""
    from eagle3.targets.placement import resolve_device
    from eagle3.targets.load import target_dtype

    device = "cuda" if cfg.evaluate.engine == "vllm" else resolve_device(cfg.evaluate.device).type
    return target_dtype(cfg.target, device)


def run(ctx: StageContext) -> dict[str, Any]:
    from eagle3.targets.fit import check_fit

    out = ctx.output
    if out is None:
        return {}
    ev = ctx.cfg.evaluate
    if ev.engine == "vllm":
        require_vllm("evaluate.engine=vllm")
    check_fit(ctx.cfg, "evaluate")
    held, prompts = held_out_prompt_ids(ctx.cfg)
    if not prompts:
        raise StageError("evaluate: no prompts to evaluate on")
    sample_ids = [p.sample_id for p in held.prompts]
    resumed = 0
    if ev.engine == "vllm":
        report = _evaluate_vllm(ctx, prompts)
    else:
        report, resumed = _evaluate_hf(ctx, prompts, sample_ids)
    report = {"engine": ev.engine, "target_dtype": _engine_dtype(ctx.cfg), "num_prompts": len(prompts),
              "prompt_source": held.source,
              "held_out": held.held_out, "max_new_tokens": ev.max_new_tokens, **report}
    if report.get("greedy_check") and not report["greedy_check"]["all_match"]:
        # Not fatal (near-ties in low precision can flip an argmax), but loud.
        report["warning"] = "speculative output differs from plain greedy output on some prompts"
    out.put_json(REPORT, report)
    path = ctx.scratch / PLOT
    plot_acceptance(report, path)
    out.put_file(PLOT, path)
    keys = ("engine", "target_dtype", "num_prompts", "held_out", "mean_acceptance_length", "draft_acceptance_rate", "verify_steps",
            "tokens_generated", "draft_tokens_proposed", "draft_tokens_accepted")
    stats = {k: report.get(k) for k in keys}
    stats["acceptance_rate_per_position"] = report["acceptance_rate_per_position"]
    if report.get("greedy_check"):
        stats["greedy_all_match"] = report["greedy_check"]["all_match"]
    stats["prompts_resumed"] = resumed
    return stats


def deep_check(store: ObjectStore, manifest: Manifest) -> list[str]:
    prefix = manifest.prefix
    try:
        report = json.loads(store.get_bytes(f"{prefix}/{REPORT}"))
    except ValueError:
        return [f"evaluate/{REPORT} does not parse"]
    problems = []
    for key in ("mean_acceptance_length", "acceptance_rate_per_position", "num_prompts", "tokens_generated",
                "draft_tokens_proposed", "draft_tokens_accepted"):
        if key not in report:
            problems.append(f"evaluate/{REPORT} lacks {key}")
    if problems:
        return problems
    k = report.get("num_draft_tokens")
    mal = report["mean_acceptance_length"]
    if mal is not None and not 1 <= mal <= k + 1:
        problems.append(f"mean_acceptance_length {mal} outside [1, {k + 1}]")
    if report["draft_tokens_accepted"] > report["draft_tokens_proposed"]:
        problems.append("more draft tokens accepted than proposed")
    cumulative = report["acceptance_rate_per_position"]["cumulative"]
    if any(b > a + 1e-9 for a, b in zip(cumulative, cumulative[1:])):
        problems.append("cumulative acceptance rises with position")
    if manifest.stats.get("mean_acceptance_length") != mal:
        problems.append("manifest stats and report disagree on mean_acceptance_length")
    head = store.get_bytes(f"{prefix}/{PLOT}")[:8]
    if head != b"\x89PNG\r\n\x1a\n":
        problems.append(f"evaluate/{PLOT} is not a PNG")
    return problems
