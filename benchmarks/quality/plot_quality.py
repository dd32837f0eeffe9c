"""Held-out acceptance length against optimizer steps: both systems, every draft vocab, one PNG."""

from __future__ import annotations

from pathlib import Path

STYLE = {"eagle3ctl": "-", "speculators": "--"}


def plot_curves(curves: dict[int, dict[str, list[dict]]], path: Path) -> Path:
    """curves: draft vocab -> system -> points ``{"step", "mean_acceptance_length", "ci95": [lo, hi]}``.

    One colour per draft vocab, one line style per system; the 95 % interval is a shaded band.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    for i, (vocab, systems) in enumerate(sorted(curves.items())):
        colour = f"C{i}"
        for system, points in sorted(systems.items()):
            points = sorted((p for p in points if p.get("mean_acceptance_length") is not None), key=lambda p: p["step"])
            if not points:
                continue
            steps = [p["step"] for p in points]
            ax.plot(steps, [p["mean_acceptance_length"] for p in points], STYLE.get(system, ":"), color=colour,
                    marker="o", ms=3, label=f"{system}, draft vocab {vocab}")
            bands = [p.get("ci95") for p in points]
            if all(bands):
                ax.fill_between(steps, [b[0] for b in bands], [b[1] for b in bands], color=colour, alpha=0.12)
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel("mean acceptance length (held-out)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
