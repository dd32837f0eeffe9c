"""Held-out acceptance length against optimizer steps: both systems, every draft vocab, one PNG."""

from __future__ import annotations

from pathlib import Path

# One line style and marker per system, one colour per draft vocab: a series of one point (a side
# evaluated only at its final checkpoint) is still told apart by its marker.
STYLE = {"eagle3ctl": ("-", "o"), "speculators": ("--", "s")}


def plot_curves(curves: dict[int, dict[str, list[dict]]], path: Path) -> Path:
    """curves: draft vocab -> system -> points ``{"step", "mean_acceptance_length", "ci95": [lo, hi]}``.

    Each point carries its 95 % interval as an error bar; the series are drawn a hair apart on the
    step axis (1 % of the longest run each) so that their bars at the same step do not hide each other.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for i, (vocab, systems) in enumerate(sorted(curves.items(), key=lambda kv: int(kv[0]))):
        for system, points in sorted(systems.items()):
            points = sorted((p for p in points if p.get("mean_acceptance_length") is not None), key=lambda p: p["step"])
            if points:
                series.append((f"C{i}", vocab, system, points))
    last_step = max((p["step"] for *_, points in series for p in points), default=1)
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    for k, (colour, vocab, system, points) in enumerate(series):
        line, marker = STYLE.get(system, (":", "^"))
        dodge = (k - (len(series) - 1) / 2) * 0.01 * last_step
        steps = [p["step"] + dodge for p in points]
        means = [p["mean_acceptance_length"] for p in points]
        bars = [p.get("ci95") for p in points]
        yerr = None
        if all(bars):
            yerr = [[m - b[0] for m, b in zip(means, bars)], [b[1] - m for m, b in zip(means, bars)]]
        ax.errorbar(steps, means, yerr=yerr, fmt=line, marker=marker, ms=4, color=colour, capsize=3, lw=1.4,
                    elinewidth=0.9, mfc=colour if system == "eagle3ctl" else "white",
                    label=f"{system}, draft vocab {vocab}")
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel("mean acceptance length (held-out, 95 % interval)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
