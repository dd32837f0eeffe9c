"""Acceptance rate per draft position, one line per system, to PNG."""

from __future__ import annotations

from pathlib import Path


MIN_REACHED = 20  # a conditional rate is drawn only where at least this many drafts reached its position


def reached_per_position(rep: dict) -> list[float] | None:
    """How many verify steps got a draft token to each position: all of them at position 1,
    then the ones accepted at the position before (from the report's counts)."""
    steps, accepted = rep.get("verify_steps"), rep.get("accepted_per_position")
    if not steps or not accepted:
        return None
    return [float(steps), *(float(a) for a in accepted[:-1])]


def plot_acceptance(systems: dict[str, dict], path: Path) -> Path:
    """systems: name -> evaluate report.json (``acceptance_rate_per_position``, ``mean_acceptance_length``,
    and ``verify_steps``/``accepted_per_position``, which hide conditional rates measured on < MIN_REACHED drafts)."""
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
        reached = reached_per_position(rep)
        if reached is not None:
            cond = [c if n >= MIN_REACHED else float("nan") for c, n in zip(cond, reached)]
        if cond:
            ax.plot(range(1, len(cond) + 1), cond, marker="x", ls="--", color=color, alpha=0.6,
                    label=f"{name} (conditional)")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("EAGLE-3 acceptance per position, held-out prompts")
    ax.text(0.99, 0.01, f"conditional: where >= {MIN_REACHED} drafts reached the position", transform=ax.transAxes,
            ha="right", va="bottom", fontsize=7, alpha=0.7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
