"""The acceptance report: pure aggregation of decode results, and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def acceptance_rates(accepted_at: list[int], steps: int) -> dict[str, list[float]]:
    """Per draft position i: cumulative = P(drafts 0..i all accepted); conditional =
    P(draft i accepted | drafts 0..i-1 accepted)."""
    cumulative = [a / steps if steps else 0.0 for a in accepted_at]
    conditional = []
    previous = steps
    for a in accepted_at:
        conditional.append(a / previous if previous else 0.0)
        previous = a
    return {"conditional": [round(x, 4) for x in conditional], "cumulative": [round(x, 4) for x in cumulative]}


def summarize(k: int, accept_lengths: list[int], accepted_at: list[int], tokens_generated: int) -> dict[str, Any]:
    steps = len(accept_lengths)
    accepted = sum(accept_lengths) - steps
    histogram = [0] * (k + 1)
    for a in accept_lengths:
        histogram[a - 1] += 1
    return {
        "num_draft_tokens": k,
        "verify_steps": steps,
        "tokens_generated": tokens_generated,
        "draft_tokens_proposed": steps * k,
        "draft_tokens_accepted": accepted,
        "mean_acceptance_length": round(sum(accept_lengths) / steps, 4) if steps else None,
        "draft_acceptance_rate": round(accepted / (steps * k), 4) if steps else None,
        "accepted_per_position": accepted_at,
        "acceptance_rate_per_position": acceptance_rates(accepted_at, steps),
        "acceptance_length_histogram": {str(i + 1): c for i, c in enumerate(histogram)},
    }


def summarize_counts(k: int, drafts: int, draft_tokens: int, accepted: int, accepted_at: list[int],
                     tokens_generated: int) -> dict[str, Any]:
    """The same report from engine counters (vLLM keeps totals, not per-step lengths)."""
    return {
        "num_draft_tokens": k,
        "verify_steps": drafts,
        "tokens_generated": tokens_generated,
        "draft_tokens_proposed": draft_tokens,
        "draft_tokens_accepted": accepted,
        "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
        "draft_acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        "accepted_per_position": accepted_at,
        "acceptance_rate_per_position": acceptance_rates(accepted_at, drafts),
        "acceptance_length_histogram": None,
    }


def plot_acceptance(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = report["acceptance_rate_per_position"]
    k = len(rates["cumulative"])
    xs = list(range(1, k + 1))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.4
    ax.bar([x - width / 2 for x in xs], rates["conditional"], width, label="conditional")
    ax.bar([x + width / 2 for x in xs], rates["cumulative"], width, label="cumulative")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_xticks(xs)
    mal = report.get("mean_acceptance_length")
    ax.set_title(f"acceptance per position (mean acceptance length {mal if mal is not None else 'n/a'})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
