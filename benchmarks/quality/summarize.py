"""The race's summary: acceptance with 95 % intervals, and ratios only where both sides finished.

Every acceptance number is a mean over verify steps of the held-out prompts both systems
decoded with the same evaluator (curve.py). Intervals are seeded bootstraps over prompts: a
prompt weighs by its verify steps, as the mean over steps does; the ratio's interval resamples
the same prompts for both sides (paired), so it says how much of a difference is the choice
of prompts, not of the systems.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

DRAWS = 2000
SEED = 0
# What a training result was trained with beyond the data (run_quality.Bench.recipe), and what a result saved
# before that was kept was trained with. The keys both systems take must match for an acceptance ratio.
RECIPE_DEFAULTS: dict[str, Any] = {"train_steps": None, "ttt_decay": 0.8, "optimizer": "adamw", "lr": 5e-4,
                                   "teacher_temperature": 1.0, "lm_head": "target", "min_lr_ratio": 0.1, "adamw_lr": None,
                                   "feature_noise": 0.0, "muon_weight_decay": 0.1, "seed": 0,
                                   "loss_tokens": "assistant", "loss_fn": "kl_div"}
# What a curve point's number depends on besides the drafter; a point saved before it was kept was decoded so.
EVALUATOR_DEFAULTS: dict[str, Any] = {"eval_prompts": 64, "eval_new_tokens": 96, "draft_tokens": 7}
# the keys both systems' recipes have (train_steps may differ: ours' --ours-train-steps); then each its own key
SHARED = ("train_steps", "ttt_decay", "optimizer", "lr")
# what both must share for an acceptance ratio; train_steps: a side short of its steps counts as missing, and sides
# trained for different steps get their ratio labelled ("unequal_steps")
MATCHED = ("ttt_decay", "optimizer", "lr")
# ours' own settings (the train stage's): the teacher, the draft head trained or frozen, where the cosine ends, the
# peak lr of Muon's AdamW group (the head and norms; None: --lr), the feature noise, Muon's weight decay, the seed
# (the drafter's init, the data order, the train stage's held-out split: another seed is another training), and which
# tokens of a sample teach the drafter (the response's, or every one: the same samples, more of their positions)
OURS_OWN = ("teacher_temperature", "lm_head", "min_lr_ratio", "adamw_lr", "feature_noise", "muon_weight_decay", "seed",
            "loss_tokens")
# A step's status in a race report, as run_quality writes it and the readers below (device_call.sh's) take it:
# ran in this call ("done in 12.3s"), or skipped as done earlier at this call's recipe (alone) or at another
# ("done earlier with ...").
DONE_IN = "done in "
DONE_EARLIER = "done earlier"


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


def point_evaluator(report: dict) -> dict[str, Any]:
    """The evaluator settings a curve point's report was decoded with."""
    return report.get("evaluator", EVALUATOR_DEFAULTS)


def _per_prompt(report: dict) -> dict[int, tuple[float, int]]:
    """id -> (sum of accept lengths, verify steps), from a report's per_prompt rows."""
    return {r["id"]: (r["mean_acceptance_length"] * r["verify_steps"], r["verify_steps"])
            for r in report.get("per_prompt") or [] if r.get("verify_steps")}


def _quantiles(boot: list[float]) -> list[float]:
    boot = sorted(boot)
    return [round(boot[int(0.025 * len(boot))], 4), round(boot[int(0.975 * len(boot)) - 1], 4)]


def _bootstrap(ids: list[int], statistic: Callable[[list[int]], float], draws: int, seed: int) -> tuple[float, list[float]]:
    """The statistic over ``ids`` and its seeded 95 % bootstrap interval (prompts drawn with replacement)."""
    rng = random.Random(seed)
    boot = [statistic([rng.choice(ids) for _ in ids]) for _ in range(draws)]
    return round(statistic(ids), 4), _quantiles(boot)


def _mean_length(rows: dict[int, tuple[float, int]], sample: list[int]) -> float:
    return sum(rows[i][0] for i in sample) / sum(rows[i][1] for i in sample)


def acceptance_ci(report: dict, draws: int = DRAWS, seed: int = SEED) -> dict | None:
    """Mean acceptance length over the report's prompts with a 95 % bootstrap interval; None under 2 prompts."""
    rows = _per_prompt(report)
    ids = sorted(rows)
    if len(ids) < 2:
        return None
    mean, ci = _bootstrap(ids, lambda sample: _mean_length(rows, sample), draws, seed)
    return {"mean_acceptance_length": mean, "ci95": ci, "prompts": len(ids)}


def acceptance_ratio_ci(ours: dict, theirs: dict, draws: int = DRAWS, seed: int = SEED) -> dict | None:
    """ours / theirs mean acceptance length with a 95 % paired-bootstrap interval over the prompts
    both decoded (matched by id); None under 2 shared prompts."""
    a, b = _per_prompt(ours), _per_prompt(theirs)
    ids = sorted(set(a) & set(b))
    if len(ids) < 2:
        return None
    ratio_, ci = _bootstrap(ids, lambda sample: _mean_length(a, sample) / _mean_length(b, sample), draws, seed)
    return {"ratio": ratio_, "ci95": ci, "prompts": len(ids), "draws": draws}


def recipe(result: dict, ours: bool) -> dict[str, Any]:
    """A training result's recipe: the keys its side trains with (ours a teacher temperature, speculators a
    loss), a key it lacks read as what results were trained with before it was kept."""
    own = OURS_OWN if ours else ("loss_fn",)
    return {k: result.get(k, RECIPE_DEFAULTS[k]) for k in (*SHARED, *own)}


def refused(missing: list[str]) -> str:
    return f"not reported: {', '.join(missing)} missing"


def ratio(name_a: str, a: float | None, name_b: str, b: float | None) -> float | str:
    """a / b, or the refusal naming the side that has no number."""
    missing = [n for n, v in ((name_a, a), (name_b, b)) if not v]
    return refused(missing) if missing else round(a / b, 3)  # type: ignore[operator]


def steady_train_seconds(side: dict) -> float | None:
    """A side's training time at its steady rate: its tokens (ours counts them; speculators logs its mean per
    step) over its steady tokens/s, start-up and compile left out as the throughput ratio leaves them out."""
    train = side.get("train") or {}
    tokens = train.get("tokens") or (train.get("mean_tokens_per_step") or 0) * (side.get("final_step") or 0)
    rate = train.get("steady_tokens_per_s")
    return round(tokens / rate, 1) if tokens and rate else None


def variant_summary(ours: dict | None, spec: dict | None, steps: int | None = None,
                    theirs: str = "speculators", ours_steps: int | None = None) -> dict[str, Any]:
    """One draft vocab's race: each side's final acceptance (CI), training numbers, and the ratios.

    ``ours`` / ``spec``: {"final": evaluator report of the last checkpoint (None: not evaluated yet),
    "final_step", "train": {...}} or None. A side that trained fewer than ``steps`` optimizer steps
    counts as missing (a CPU ``--dry-run`` of speculators saves its untrained drafter: step 0). A
    side trained but not yet evaluated keeps its training numbers, so the throughput and memory
    ratios come out of a call the deadline cut before the curve. Sides trained with different
    :data:`MATCHED` settings get no acceptance ratio. ``theirs``: the other side's name. ``ours_steps``: the
    steps ours trains when not ``steps`` (``--ours-train-steps``: a race at equal training seconds, which the
    ratio then says it is, with each side's steady training seconds).
    """
    out: dict[str, Any] = {}
    if ours and ours.get("draft_vocab_coverage") is not None:  # share of generated tokens the draft vocab holds
        out["draft_vocab_coverage"] = ours["draft_vocab_coverage"]
    trained, evaluated = {}, {}
    sides = (("eagle3ctl", ours), (theirs, spec))
    recipes = {name: recipe(side, name == "eagle3ctl") for name, side in sides if side}
    for name, side in sides:
        need = (ours_steps or steps) if name == "eagle3ctl" else steps  # the steps this side must have trained
        if not side:
            out[name] = refused([name])
        elif need is not None and (side.get("final_step") or 0) < need:
            out[name] = refused([f"{name} (trained {side.get('final_step') or 0} of {need} steps)"])
        else:
            trained[name] = side.get("train") or {}
            evaluated[name] = bool(side.get("final"))
            out[name] = {"acceptance": acceptance_ci(side["final"]) if evaluated[name]
                         else refused([f"{name}'s evaluated final checkpoint"]),
                         "steps": side.get("final_step"), "recipe": recipes[name], "train": side.get("train"),
                         "steady_train_seconds": steady_train_seconds(side)}
    mine, other = recipes.get("eagle3ctl"), recipes.get(theirs)
    unmatched = [f"{k} {mine[k]} vs {other[k]}" for k in MATCHED if mine and other and mine[k] != other[k]]
    if unmatched:  # e.g. one side retrained with --ttt-decay, the other's result from an earlier call
        out["acceptance_ratio"] = f"not reported: trained with different recipes ({', '.join(unmatched)})"
    elif all(evaluated.get(n) for n in ("eagle3ctl", theirs)):
        out["acceptance_ratio"] = acceptance_ratio_ci(ours["final"], spec["final"]) or refused(["shared prompts"])
        counts = {n: recipes[n]["train_steps"] for n in ("eagle3ctl", theirs)}
        if isinstance(out["acceptance_ratio"], dict) and None not in counts.values() and len(set(counts.values())) > 1:
            out["acceptance_ratio"]["unequal_steps"] = (
                f"{', '.join(f'{n} {c} steps' for n, c in counts.items())}: a race at equal training seconds where "
                "each side's steady_train_seconds agree, not the race at equal steps and tokens the acceptance goal "
                "is set for")
    else:
        out["acceptance_ratio"] = refused([n for n in ("eagle3ctl", theirs) if not evaluated.get(n)])
    ot, st = trained.get("eagle3ctl", {}), trained.get(theirs, {})
    out["throughput_ratio"] = ratio("eagle3ctl", ot.get("steady_tokens_per_s"), theirs, st.get("steady_tokens_per_s"))
    out["peak_memory_ratio"] = ratio("eagle3ctl", ot.get("peak_memory_gib"), theirs, st.get("peak_memory_gib"))
    return out


def summarize(target: dict | None, variants: dict[int, dict[str, dict | None]], status: dict[str, str],
              args: dict[str, Any], names: dict[str, str] | None = None) -> dict:
    """The JSON summary: target, per draft vocab the race (``ours`` against ``spec``; each further
    side, named in ``names``, against ours under ``vs``), and what each step did."""
    head: dict[str, Any] = {}
    if target:
        head["target"] = {k: target.get(k) for k in ("parameters", "train_tokens", "train_seconds", "heldout_loss",
                                                     "train_tokens_per_s")}
    head["goals"] = "acceptance ratio >= 1.1 with ci95 above 1.0; throughput ratio >= 1.5; peak memory ratio <= 1.0"
    head["by_draft_vocab"] = {}
    steps, ours_steps = args.get("train_steps"), args.get("ours_train_steps")
    for v, sides in sorted(variants.items()):
        race = variant_summary(sides.get("ours"), sides.get("spec"), steps, ours_steps=ours_steps)
        for side in (s for s in sides if s not in ("ours", "spec")):
            name = (names or {}).get(side, side)
            control = variant_summary(sides.get("ours"), sides[side], steps, name, ours_steps)
            for ours_only in ("eagle3ctl", "draft_vocab_coverage"):  # in the race above already
                control.pop(ours_only, None)
            race.setdefault("vs", {})[name] = control
        head["by_draft_vocab"][str(v)] = race
    return {"headline": head, "status": status, "args": args}


def _point(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"summarize: cannot read {path}: {e}") from None


def _point_ratio(a: dict, b: dict, path_a: str, path_b: str) -> dict:
    """A / B on the prompts both points decoded; points of different evaluators are refused in one line."""
    if point_evaluator(a) != point_evaluator(b):
        raise SystemExit(f"summarize: {path_a} and {path_b} were evaluated differently "
                         f"({point_evaluator(a)} vs {point_evaluator(b)}): no paired ratio")
    ratio_ = acceptance_ratio_ci(a, b)
    if ratio_ is None:
        raise SystemExit(f"summarize: {path_a} and {path_b} share fewer than 2 decoded prompts")
    return ratio_


def _point_summary(point: dict, path: str) -> dict:
    return {"path": path, "step": point.get("step"), **(acceptance_ci(point) or {})}


def _per_position(a: dict, b: dict) -> dict[str, list] | None:
    """Each point's acceptance at every draft position, conditional on the positions before it (over all the
    prompts it decoded, not paired), and A / B per position: where a lead in the mean comes from."""
    ca, cb = ((p.get("acceptance_rate_per_position") or {}).get("conditional") for p in (a, b))
    if not ca or not cb or len(ca) != len(cb):
        return None
    return {"a": ca, "b": cb, "a_over_b": [round(x / y, 3) if y else None for x, y in zip(ca, cb, strict=True)]}


def paired(path_a: str, path_b: str) -> dict[str, Any]:
    """Two curve points' reports (``curve/<side>-v<vocab>/step-NNNNNNN.json``, as ``device_call.sh`` brings
    them back in ``curve_points.tgz``) compared on the prompts both decoded: each mean with its interval
    and the paired ratio A / B, then the conditional acceptance per draft position of each and its ratio.
    Two trainings of one side on one target (a sweep's settings) have no ratio in the race's summary; this
    gives it. Points of different evaluators are refused."""
    a, b = _point(path_a), _point(path_b)
    ratio_ = _point_ratio(a, b, path_a, path_b)
    out = {"a": _point_summary(a, path_a), "b": _point_summary(b, path_b), "a_over_b": ratio_}
    per_position = _per_position(a, b)
    if per_position:
        out["conditional_per_position"] = per_position
    return out


def setting_name(path: str) -> str:
    """A sweep setting's name from its point's path: the folder holding ``curve/`` (``sweep/<name>/curve/...``),
    else the point's own folder."""
    parts = Path(path).parts[:-1]
    at = len(parts) - 1 - parts[::-1].index("curve") if "curve" in parts else 0
    return parts[at - 1] if at > 0 else str(Path(path).parent)


def settings(base: str, others: list[str], png: str | None = None) -> dict[str, Any]:
    """Each of a sweep's settings against one of them (``base``), paired on the prompts both decoded: the
    sweep's table in one call, and with ``png`` its picture: each setting's ratio to the base with its
    paired 95 % interval (a bar crossing 1.0 is no difference on these prompts)."""
    base_point = _point(base)
    rows = []
    for path in others:
        point = _point(path)
        rows.append({"setting": setting_name(path), **_point_summary(point, path),
                     "over_base": _point_ratio(point, base_point, path, base)})
    table = {"base": {"setting": setting_name(base), **_point_summary(base_point, base)}, "settings": rows}
    if png:
        _plot_settings(table, Path(png))
        table["png"] = png
    return table


def _plot_settings(table: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table["settings"]
    fig, ax = plt.subplots(figsize=(7.0, 1.2 + 0.45 * len(rows)))
    for y, r in enumerate(rows):
        ratio_, (lo, hi) = r["over_base"]["ratio"], r["over_base"]["ci95"]
        ax.errorbar([ratio_], [y], xerr=[[ratio_ - lo], [hi - ratio_]], fmt="o", color="C0", capsize=3)
        ax.annotate(f"{r['mean_acceptance_length']:.3f}", (hi, y), xytext=(4, -3), textcoords="offset points",
                    fontsize=7)
    ax.axvline(1.0, color="grey", ls="--", lw=1)
    ax.set_yticks(range(len(rows)), [r["setting"] for r in rows], fontsize=7)
    base = table["base"]
    ax.invert_yaxis()  # the settings top to bottom in the order given
    ax.set_title(f"against {base['setting']} ({base['mean_acceptance_length']:.3f})", fontsize=8)
    ax.set_xlabel("acceptance length ratio, paired 95 % interval (label: the setting's mean)", fontsize=8)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ours_finished(report: str | Path) -> bool:
    """Whether a race report says ours trained at its call's recipe (now, or earlier at that recipe) at every vocab
    it ran and its curve points were all evaluated: what a sweep setting needs to be marked finished. A result of
    another recipe kept without --retrain ("done earlier with ..."), a cut training or a skipped point is not."""
    status = json.loads(Path(report).read_text())["status"]
    ours = [v for k, v in status.items() if k.startswith("ours_v")]
    return bool(ours) and all(v == DONE_EARLIER or v.startswith(DONE_IN) for v in ours) \
        and status.get("curve", "").startswith((DONE_IN, DONE_EARLIER))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="summarize.py", description=paired.__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("paired", help="A / B on the prompts both curve points decoded, with a paired 95 %% interval")
    p.add_argument("a", help="a curve point's report (step-NNNNNNN.json): the numerator")
    p.add_argument("b", help="the other point's report: the denominator")
    s = sub.add_parser("settings", help="each setting's point against the base's, paired, as one table; "
                       "--png plots the ratios")
    s.add_argument("base", help="the base setting's curve point (sweep/<name>/curve/<side>-v<vocab>/step-N.json)")
    s.add_argument("others", nargs="+", help="the other settings' points at the same step")
    s.add_argument("--png", help="where to plot each setting's ratio to the base")
    f = sub.add_parser("ours-finished", help="exit 0 when the race report says ours trained and its points are "
                       "evaluated, 1 when not")
    f.add_argument("report", help="a race report (quality_race.json)")
    args = ap.parse_args(argv)
    if args.command == "ours-finished":
        raise SystemExit(0 if ours_finished(args.report) else 1)
    if args.command == "settings":
        print(json.dumps(settings(args.base, args.others, args.png), indent=1))
        return
    print(json.dumps(paired(args.a, args.b), indent=1))


if __name__ == "__main__":
    main()
