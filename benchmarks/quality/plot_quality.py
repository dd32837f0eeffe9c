"""Held-out acceptance length against optimizer steps and, where known, against steady training seconds:
both systems, every draft vocab, one PNG."""

from __future__ import annotations

from pathlib import Path

# One line style and marker per system (a series' name begins with its system's), one colour per series: a
# series of one point (a side evaluated only at its final checkpoint) is still told apart by its marker.
STYLE = {"eagle3ctl": ("-", "o"), "speculators": ("--", "s")}


def _panel(ax, series: list[tuple[str, str, str, list[dict]]], x: str) -> None:
    """Each series' points at ``x`` (``step`` or ``seconds``) with their 95 % intervals as error bars, drawn a hair
    apart on the x axis (1 % of its longest run each) so that bars at one x do not hide each other."""
    last = max((p[x] for *_, points in series for p in points), default=1)
    for k, (colour, label, system, points) in enumerate(series):
        line, marker = STYLE.get(system, (":", "^"))
        dodge = (k - (len(series) - 1) / 2) * 0.01 * last
        xs = [p[x] + dodge for p in points]
        means = [p["mean_acceptance_length"] for p in points]
        bars = [p.get("ci95") for p in points]
        yerr = None
        if all(bars):
            yerr = [[m - b[0] for m, b in zip(means, bars)], [b[1] - m for m, b in zip(means, bars)]]
        ax.errorbar(xs, means, yerr=yerr, fmt=line, marker=marker, ms=4, color=colour, capsize=3, lw=1.4,
                    elinewidth=0.9, mfc=colour if system == "eagle3ctl" else "white", label=label)
    ax.set_xlabel({"step": "optimizer steps", "seconds": "steady training seconds (tokens / steady tokens/s)"}[x])
    ax.set_ylabel("mean acceptance length (held-out, 95 % interval)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_curves(curves: dict[int, dict[str, list[dict]]], path: Path) -> Path:
    """curves: draft vocab -> series -> points ``{"step", "mean_acceptance_length", "ci95": [lo, hi]}`` and, where
    the side's steady rate is known, ``"seconds"``. A series is named by its system, optionally followed by more
    (``"eagle3ctl, 3,000-step schedule"``). With seconds on any series, a second panel draws those series against
    them: where a faster trainer's lead shows, at equal training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for vocab, systems in sorted(curves.items(), key=lambda kv: int(kv[0])):
        for name, points in sorted(systems.items()):
            points = sorted((p for p in points if p.get("mean_acceptance_length") is not None), key=lambda p: p["step"])
            if points:
                series.append((f"C{len(series)}", f"{name}, draft vocab {vocab}", name.split(",")[0], points))
    timed = [s for s in series if all(p.get("seconds") is not None for p in s[3])]
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(12.0 if timed else 7.0, 4.4), squeeze=False)
    _panel(axes[0][0], series, "step")
    if timed:
        _panel(axes[0][1], timed, "seconds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
