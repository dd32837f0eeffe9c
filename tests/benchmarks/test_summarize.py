"""The quality benchmark's summary (benchmarks/quality/summarize.py): the acceptance ratio's interval."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "quality_summarize", Path(__file__).resolve().parents[2] / "benchmarks" / "quality" / "summarize.py")
summarize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summarize)
acceptance_ratio_ci = summarize.acceptance_ratio_ci


def report(lengths: dict[int, float], steps: int = 50) -> dict:
    return {"per_prompt": [{"id": i, "verify_steps": steps, "mean_acceptance_length": m} for i, m in lengths.items()]}


def test_paired_bootstrap_brackets_the_ratio_and_narrows_with_agreeing_prompts():
    rng = random.Random(1)
    base = {i: 1.5 + rng.random() for i in range(32)}
    same_shift = acceptance_ratio_ci(report({i: m * 1.02 for i, m in base.items()}), report(base))
    assert same_shift["ratio"] == 1.02 and same_shift["ci95"] == [1.02, 1.02]  # paired: prompt difficulty cancels
    noisy = acceptance_ratio_ci(report({i: m + rng.uniform(-0.3, 0.3) for i, m in base.items()}), report(base))
    lo, hi = noisy["ci95"]
    assert lo < noisy["ratio"] < hi and hi - lo > 0.02 and noisy["prompts"] == 32


def test_only_prompts_both_decoded_count():
    ours = report({1: 2.0, 2: 2.0, 3: 9.0})
    theirs = report({1: 1.0, 2: 1.0})
    assert acceptance_ratio_ci(ours, theirs)["ratio"] == 2.0 and acceptance_ratio_ci(ours, theirs)["prompts"] == 2
    assert acceptance_ratio_ci(report({1: 2.0}), theirs) is None  # one shared prompt: no interval


def test_steady_rate_leaves_out_the_start_and_the_profiled_windows():
    records = [{"step": s, "tokens_per_s": r} for s, r in [(5, 10.0), (10, 100.0), (15, 102.0), (20, 30.0), (25, 101.0)]]
    assert summarize.steady(records) == 100.5  # the first 20 % (compiling) is left out, the median of the rest
    # steps 15..16 (0-based) were profiled: the window logged at step 20 (steps 15..19) is left out
    assert summarize.steady(records, profiled=[15, 17]) == 101.0
