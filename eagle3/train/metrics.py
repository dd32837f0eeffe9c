"""Training metrics: metrics.jsonl, TensorBoard event files, and loss.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3.manifest import StageOutput


class MetricsLog:
    """Appends one JSON record per logged step to a local file and to TensorBoard (rank 0 only)."""

    def __init__(self, local_dir: Path, records: list[dict[str, Any]] | None = None) -> None:
        self.dir = local_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.records: list[dict[str, Any]] = list(records or [])
        self.path = self.dir / "metrics.jsonl"
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self.tb_dir = self.dir / "tensorboard"
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(self.tb_dir))

    def log(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        step = int(rec["step"])
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)):
                self.tb.add_scalar(k.replace("_", "/", 1) if k.startswith(("loss_", "acc_", "eval_")) else k, v, step)

    def flush(self) -> None:
        self.tb.flush()

    def tb_files(self) -> list[Path]:
        return sorted(p for p in self.tb_dir.rglob("*") if p.is_file())

    def upload(self, output: StageOutput) -> None:
        """metrics.jsonl and the TensorBoard event files so far into the stage output."""
        self.flush()
        output.put_file("metrics.jsonl", self.path)
        for p in self.tb_files():
            output.put_file(f"tensorboard/{p.relative_to(self.tb_dir).as_posix()}", p)

    def close(self) -> None:
        self.tb.close()


def parse_metrics(text: str) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; raises ValueError naming the first bad line."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if not isinstance(rec, dict) or "step" not in rec or "loss" not in rec:
            raise ValueError(f"line {n} is not a metrics record")
        out.append(rec)
    return out


def plot_loss(records: list[dict[str, Any]], path: Path, ttt_steps: int) -> None:
    """Total loss and per-TTT-step accuracy against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in records]
    ax_loss.plot(steps, [r["loss"] for r in records], label="total (weighted)")
    for k in range(ttt_steps):
        if records and f"loss_{k}" in records[0]:
            ax_loss.plot(steps, [r[f"loss_{k}"] for r in records], lw=0.8, alpha=0.6, label=f"step {k}")
        if records and f"acc_{k}" in records[0]:
            ax_acc.plot(steps, [r[f"acc_{k}"] for r in records], label=f"step {k}")
    ax_loss.set(xlabel="optimizer step", ylabel="KL (nats)", title="TTT loss")
    ax_acc.set(xlabel="optimizer step", ylabel="top-1 agreement", title="draft accuracy per TTT step", ylim=(0, 1))
    ax_loss.legend(fontsize=7)
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
