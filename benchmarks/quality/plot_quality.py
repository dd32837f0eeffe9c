"""Acceptance rate per draft position, one line per system, to PNG."""

from __future__ import annotations

from pathlib import Path


def plot_acceptance(systems: dict[str, dict], path: Path) -> Path:
    """systems: name -> evaluate report.json (``acceptance_rate_per_position``, ``mean_acceptance_length``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, (name, rep) in enumerate(systems.items()):
        rates = rep.get("acceptance_rate_per_position") or {}
        if isinstance(rates, list):
            rates = {"cumulative": rates}
        tau = rep.get("mean_acceptance_length")
        label = f"{name}: τ={tau:.2f}" if isinstance(tau, (int, float)) else name
        color = f"C{i}"
        cum = rates.get("cumulative") or []
        ax.plot(range(1, len(cum) + 1), cum, marker="o", color=color, label=f"{label} (cumulative)")
        cond = rates.get("conditional") or []
        if cond:
            ax.plot(range(1, len(cond) + 1), cond, marker="x", ls="--", color=color, alpha=0.6,
                    label=f"{name} (conditional)")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("EAGLE-3 acceptance per position, held-out prompts")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
