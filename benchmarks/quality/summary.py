"""The race's results: each side's acceptance with its 95 % interval, the paired ratio, throughput and memory,
vLLM's figures, as one JSON and one PNG.

Acceptance is the mean acceptance length over the verify steps of the held-out prompts, the bonus token
counted (k drafts accepted + 1). Intervals are seeded bootstraps over prompts, each prompt weighing by its
verify steps; the ratio's interval resamples the same prompts for both sides (paired), so it says how much of
a difference is the choice of prompts. vLLM keeps counters, not per-prompt rows: its figures have no
interval. A ratio is reported only where both sides trained the steps asked; a number that was not measured
says why, never a stand-in.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

DRAWS, SEED = 2000, 0
SIDES = ("eagle3ctl", "speculators")


def steady(records: list[dict], key: str = "tokens_per_s", skip: float = 0.2) -> float | None:
    """The median of a logged rate after the first ``skip`` of its records (start-up, compilation)."""
    rates = [r[key] for r in records if r.get(key)]
    kept = rates[int(len(rates) * skip):] or rates
    return round(statistics.median(kept), 1) if kept else None


def per_prompt(report: dict) -> dict[int, tuple[float, int]]:
    """Prompt id -> (sum of its acceptance lengths, its verify steps), from a report's per_prompt rows."""
    return {r["id"]: (r["mean_acceptance_length"] * r["verify_steps"], r["verify_steps"])
            for r in report.get("per_prompt") or [] if r.get("verify_steps")}


def _mean(rows: dict[int, tuple[float, int]], ids: list[int]) -> float:
    return sum(rows[i][0] for i in ids) / sum(rows[i][1] for i in ids)


def bootstrap(ids: list[int], statistic: Callable[[list[int]], float]) -> tuple[float, list[float]]:
    """The statistic over ``ids`` and its seeded 95 % interval, prompts drawn with replacement."""
    rng = random.Random(SEED)
    draws = sorted(statistic([rng.choice(ids) for _ in ids]) for _ in range(DRAWS))
    return round(statistic(ids), 4), [round(draws[int(0.025 * DRAWS)], 4), round(draws[int(0.975 * DRAWS) - 1], 4)]


def acceptance_ci(report: dict) -> dict | None:
    """Mean acceptance length over the report's prompts with its 95 % interval; None under 2 prompts."""
    rows = per_prompt(report)
    if len(rows) < 2:
        return None
    mean, ci = bootstrap(sorted(rows), lambda ids: _mean(rows, ids))
    return {"mean_acceptance_length": mean, "ci95": ci, "prompts": len(rows)}


def ratio_ci(ours: dict, theirs: dict) -> dict | None:
    """ours / theirs mean acceptance length, paired over the prompts both decoded; None under 2 of them."""
    a, b = per_prompt(ours), per_prompt(theirs)
    ids = sorted(set(a) & set(b))
    if len(ids) < 2:
        return None
    value, ci = bootstrap(ids, lambda s: _mean(a, s) / _mean(b, s))
    return {"ratio": value, "ci95": ci, "prompts": len(ids), "draws": DRAWS}


def ratio(name: str, ours: float | None, theirs: float | None) -> float | str:
    if not ours or not theirs:
        missing = " and ".join(s for s, v in zip(SIDES, (ours, theirs)) if not v)
        return f"not reported: {name} not measured for {missing}"
    return round(ours / theirs, 3)


def side(trained: dict | None, report: dict | None, state: str) -> dict | str:
    """One side's figures: its training's steps, rate and memory, and its acceptance (hf)."""
    if trained is None:
        return state
    out = {k: trained.get(k) for k in ("final_step", "steady_tokens_per_s", "peak_memory_gib", "resumed_from_step")}
    if trained.get("dry_run"):
        out["note"] = "its trainer needs a CUDA device: --dry-run saved its drafter untrained"
    out["acceptance"] = (acceptance_ci(report) or "not reported: under 2 prompts decoded") if report else state
    if report:
        out["conditional_per_position"] = report["acceptance_rate_per_position"]["conditional"]
    return out


def vllm_figures(reports: dict[str, dict | None], states: dict[str, str], full: bool) -> dict:
    out: dict[str, Any] = {}
    for name, key in zip(SIDES, ("vllm_ours", "vllm_spec")):
        r, why = reports[key], states[key].removeprefix("not run: ")
        out[name] = {k: r[k] for k in ("mean_acceptance_length", "acceptance_rate_per_position", "verify_steps",
                                       "vllm_version", "dtype")} if r else f"not measured: {why}"
    means = [reports[k]["mean_acceptance_length"] if reports[k] else None for k in ("vllm_ours", "vllm_spec")]
    out["acceptance_ratio"] = ratio("vLLM acceptance", *means) if full else "not reported: a side is short of its steps"
    return out


def summarize(results: dict[str, dict | None], states: dict[str, str], recipe: dict) -> dict:
    """The race's JSON from its steps' results (None: not done) and each step's state."""
    ours, spec = results["ours"], results["spec_train"]
    asked = recipe["train_steps"]
    short = [f"{n} trained {t['final_step']} of {asked} steps" for n, t in zip(SIDES, (ours, spec))
             if t and (t.get("final_step") or 0) < asked]
    target = {k: v for k, v in (results["target"] or {}).items() if k != "paths"}
    out: dict[str, Any] = {"target": target, "recipe": recipe, "draft_vocab_coverage": (ours or {}).get(
        "draft_vocab_coverage"), "eagle3ctl": side(ours, results["ours_report"], states["ours"]),
        "speculators": side(spec, results["spec_eval"], states["spec_train"])}
    both = ours and spec and results["spec_eval"]
    if not both:
        out["acceptance_ratio"] = "not reported: " + "; ".join(
            f"{s} {states[s]}" for s in ("ours", "spec_train", "spec_eval") if not results[s])
    elif short:
        out["acceptance_ratio"] = "not reported: " + "; ".join(short)
    else:
        out["acceptance_ratio"] = (ratio_ci(results["ours_report"], results["spec_eval"])
                                   or "not reported: under 2 shared prompts")
    o, s = ours or {}, spec or {}
    out["throughput_ratio"] = ratio("steady tokens/s", o.get("steady_tokens_per_s"), s.get("steady_tokens_per_s"))
    out["peak_memory_ratio"] = ratio("CUDA peak memory", o.get("peak_memory_gib"), s.get("peak_memory_gib"))
    out["vllm"] = vllm_figures(results, states, bool(both) and not short)
    out["steps"] = states
    return out


def plot(summary: dict, path: Path) -> None:
    """Mean acceptance length of each side (hf with its 95 % interval, vLLM beside it), and the conditional
    acceptance at each draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11.0, 4.2))
    for x, name in enumerate(SIDES):
        hf, vl = summary[name], summary["vllm"].get(name)
        acc = hf.get("acceptance") if isinstance(hf, dict) else None
        if isinstance(acc, dict):
            m, (lo, hi) = acc["mean_acceptance_length"], acc["ci95"]
            left.errorbar([x - 0.1], [m], yerr=[[m - lo], [hi - m]], fmt="o", color=f"C{x}", capsize=4,
                          label=f"{name}, hf (95 %)")
            right.plot(range(1, len(hf["conditional_per_position"]) + 1), hf["conditional_per_position"], "-o",
                       color=f"C{x}", label=f"{name}, hf")
        if isinstance(vl, dict):
            left.plot([x + 0.1], [vl["mean_acceptance_length"]], "s", color=f"C{x}", mfc="white",
                      label=f"{name}, vLLM ({vl['dtype']})")
            cond = vl["acceptance_rate_per_position"]["conditional"]
            right.plot(range(1, len(cond) + 1), cond, "--s", color=f"C{x}", mfc="white", label=f"{name}, vLLM")
    r, ratio_, vllm_ratio = summary["recipe"], summary["acceptance_ratio"], summary["vllm"]["acceptance_ratio"]
    title = f"{r['train_steps']} steps a side, draft vocab {r['draft_vocab']}"
    if isinstance(ratio_, dict):
        title += f"\neagle3ctl / speculators: {ratio_['ratio']:.3f} [{ratio_['ci95'][0]:.3f}, {ratio_['ci95'][1]:.3f}]"
        title += f", in vLLM {vllm_ratio:.3f}" if isinstance(vllm_ratio, float) else ""
    left.set_xticks(range(len(SIDES)), SIDES)
    left.set_xlim(-0.6, len(SIDES) - 0.4)
    left.set_ylabel(f"mean acceptance length (k = {r['draft_tokens']}, bonus token counted)")
    left.set_title(title, fontsize=9)
    right.set_xticks(range(1, r["draft_tokens"] + 1))
    right.set_xlabel("draft position")
    right.set_ylabel("acceptance, given the positions before")
    right.set_ylim(0, 1.02)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
