"""The issue-8 summary: headline numbers and ratios out of the steps' raw results."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any


def steady(records: list[dict[str, Any]], key: str = "tokens_per_s", skip: float = 0.2,
           profiled: list[int] | None = None) -> float | None:
    """Median of a windowed rate after the first ``skip`` of the windows (start-up, compile); windows
    holding a ``profiled`` step [A, B) (0-based: train.profile_steps) are left out, as the profiler slows them."""
    a, b = profiled or (0, 0)
    windows, prev = [], 0
    for r in records:
        windows.append((r.get(key), prev < b and r["step"] > a))
        prev = r["step"]
    windows = [w for w in windows if w[0]]
    kept = [v for v, in_profile in windows[int(len(windows) * skip):] if not in_profile] or [v for v, _ in windows]
    return round(statistics.median(kept), 1) if kept else None


def _report(stage: dict | None) -> dict:
    return (stage or {}).get("report") or {}


def acceptance_ratio_ci(ours: dict, theirs: dict, draws: int = 2000, seed: int = 0) -> dict | None:
    """Ratio of mean acceptance lengths (ours / theirs) with a 95 % interval from a paired bootstrap
    over the prompts both reports decoded (matched by id): how much of a small difference is the
    choice of prompts. Each prompt weighs by its verify steps, as the mean over steps does."""
    def per_prompt(rep: dict) -> dict:
        return {r["id"]: (r["mean_acceptance_length"] * r["verify_steps"], r["verify_steps"])
                for r in rep.get("per_prompt") or [] if r.get("verify_steps")}

    a, b = per_prompt(ours), per_prompt(theirs)
    ids = sorted(set(a) & set(b))
    if len(ids) < 2:
        return None

    def ratio(sample: list) -> float:
        ta = sum(a[i][0] for i in sample) / sum(a[i][1] for i in sample)
        tb = sum(b[i][0] for i in sample) / sum(b[i][1] for i in sample)
        return ta / tb

    rng = random.Random(seed)
    boot = sorted(ratio([rng.choice(ids) for _ in ids]) for _ in range(draws))
    return {"ratio": round(ratio(ids), 4), "ci95": [round(boot[int(0.025 * draws)], 4), round(boot[int(0.975 * draws) - 1], 4)],
            "prompts": len(ids), "draws": draws}


def _acceptance(rep: dict) -> dict:
    return {k: rep.get(k) for k in ("mean_acceptance_length", "acceptance_rate_per_position", "num_prompts",
                                    "num_draft_tokens", "generated_tokens", "target_greedy_match", "verify_steps",
                                    "accepted_per_position")
            if k in rep}


def ours(result: dict | None, store_root: Path | None = None) -> dict | None:
    if not result:
        return None
    st = result["stages"]
    ex, tr = st.get("extract", {}), st.get("train", {})
    index = ex.get("index", {})
    tokens = index.get("num_tokens") or sum(s.get("tokens", s.get("num_tokens", 0)) for s in index.get("shards", []))
    records = []
    if store_root is not None:
        p = store_root / result["run"] / "train" / "metrics.jsonl"
        if p.exists():
            records = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    out = {
        "acceptance": _acceptance(_report(st.get("evaluate"))),
        "generate": st.get("generate", {}).get("stats"),
        "extract": {"stats": ex.get("stats"), "storage_dtype": index.get("storage_dtype"), "tokens": tokens,
                    "shard_bytes": ex.get("shard_bytes"),
                    "bytes_per_token": round(ex["shard_bytes"] / tokens, 1) if tokens and ex.get("shard_bytes") else None},
        "evaluate": (st.get("evaluate") or {}).get("stats"),
        "train": {"stats": tr.get("stats"),
                  "steady_tokens_per_s": steady(records, profiled=((tr.get("stats") or {}).get("profile") or {}).get("steps")),
                  # every logged window: which ones compiling (or anything else) slowed down
                  "window_tokens_per_s": [r.get("tokens_per_s") for r in records],
                  "window_data_wait_frac": [r.get("data_wait_frac") for r in records],
                  "loop_tokens_per_s": (tr.get("stats") or {}).get("tokens_per_s"),
                  "peak_memory_gib": (tr.get("stats") or {}).get("peak_memory_gib"),
                  "stage_started_at": tr.get("started_at"), "stage_finished_at": tr.get("finished_at")},
    }
    return out


def spec(result: dict | None) -> dict | None:
    if not result:
        return None
    t = result["train"]
    return {
        "acceptance": _acceptance(_report(result.get("evaluate"))),
        "train": {k: t.get(k) for k in ("steady_tokens_per_s", "wall_seconds", "peak_memory_gib", "last_step",
                                        "mean_tokens_per_step", "final_train_metrics")},
        "evaluate": (result.get("evaluate") or {}).get("stats"),
        "argv": t.get("argv"),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def summarize(done: dict[str, dict | None], status: dict[str, str], args: dict[str, Any]) -> dict:
    store = Path(args["work"]) / "store" if args.get("work") else None
    o16, o8, sp = ours(done.get("ours_bf16"), store), ours(done.get("ours_fp8"), store), spec(done.get("spec"))
    head: dict[str, Any] = {}
    if done.get("target"):
        t = done["target"]
        head["target"] = {k: t.get(k) for k in ("parameters", "train_tokens", "train_seconds", "train_tokens_per_s",
                                                "heldout_loss", "corpus_tokens")}
        head["target"]["vocab_size"] = t.get("recipe", {}).get("vocab_size")
    if o16:
        head["ours_bf16"] = {
            "mean_acceptance_length": o16["acceptance"].get("mean_acceptance_length"),
            "acceptance_rate_per_position": o16["acceptance"].get("acceptance_rate_per_position"),
            "train_steady_tokens_per_s": o16["train"]["steady_tokens_per_s"],
            "train_loop_tokens_per_s": o16["train"]["loop_tokens_per_s"],
            "train_peak_memory_gib": o16["train"]["peak_memory_gib"],
            "extract_tokens_per_s": (o16["extract"]["stats"] or {}).get("tokens_per_s"),
            "hidden_bytes_per_token": o16["extract"]["bytes_per_token"],
        }
    if o8:
        head["ours_fp8"] = {
            "mean_acceptance_length": o8["acceptance"].get("mean_acceptance_length"),
            "acceptance_rate_per_position": o8["acceptance"].get("acceptance_rate_per_position"),
            "extract_tokens_per_s": (o8["extract"]["stats"] or {}).get("tokens_per_s"),
            "hidden_bytes_per_token": o8["extract"]["bytes_per_token"],
            "train_steady_tokens_per_s": o8["train"]["steady_tokens_per_s"],
        }
    if sp:
        head["speculators"] = {
            "mean_acceptance_length": sp["acceptance"].get("mean_acceptance_length"),
            "acceptance_rate_per_position": sp["acceptance"].get("acceptance_rate_per_position"),
            "train_steady_tokens_per_s": sp["train"]["steady_tokens_per_s"],
            "train_wall_seconds": sp["train"]["wall_seconds"],
            "train_peak_memory_gib": sp["train"]["peak_memory_gib"],
        }
    warm = done.get("spec_warm")
    if warm:  # compiled on random samples before anything was timed (run_quality.step_spec_warm)
        head.setdefault("speculators", {})["cold_start_seconds_6_steps"] = warm.get("cold_train_seconds_6_steps")
    if o16 and sp:
        head["ours_vs_speculators"] = {
            "acceptance_length_ratio": _ratio(head["ours_bf16"]["mean_acceptance_length"],
                                              head["speculators"]["mean_acceptance_length"]),
            "train_throughput_ratio_steady": _ratio(head["ours_bf16"]["train_steady_tokens_per_s"],
                                                    head["speculators"]["train_steady_tokens_per_s"]),
            "peak_memory_ratio": _ratio(head["ours_bf16"]["train_peak_memory_gib"],
                                        head["speculators"]["train_peak_memory_gib"]),
            "acceptance_length_ratio_paired_bootstrap": acceptance_ratio_ci(
                _report(done["ours_bf16"]["stages"].get("evaluate")), _report((done.get("spec") or {}).get("evaluate"))),
            "goals": "acceptance ratio >= 1.0; throughput ratio >= 1.5; memory ratio <= 1.0",
        }
    if o16 and o8:
        head["ours_fp8_vs_bf16"] = {"acceptance_length_ratio_paired_bootstrap": acceptance_ratio_ci(
            _report(done["ours_fp8"]["stages"].get("evaluate")), _report(done["ours_bf16"]["stages"].get("evaluate")))}
    partial = (done.get("evaluate_partial") or {}).get("partial")
    if partial:  # evaluate was cut short: acceptance on the prompts every run had finished
        head["acceptance_on_prompts_finished_by_all"] = partial
    return {"headline": head, "status": status, "args": args,
            "details": {"target": done.get("target"), "ours_bf16": o16, "ours_fp8": o8, "speculators": sp}}
