"""Train the same EAGLE-3 drafter with vllm-project/speculators, then export it in our format.

Runs speculators' own entry point (``speculators.train.cli.main`` on
``TrainConfig.resolve(argv)``, what ``python -m speculators.train`` runs) in this process,
with a logging handler (on the root logger, where its ``speculators.metrics`` records
propagate) to time its steps, and
``torch.cuda.max_memory_allocated`` for its peak memory. The drafter is configured like
ours: one Llama layer of the target's width, residual from ``fc`` (no norm before the
residual, no norm before ``fc``, no norm on the fed-back hidden), full attention, the
same draft vocab (our d2t/t2d), TTT steps and decay, its KL loss (or ``--loss-fn``), AdamW
with the same LR, warmup and cosine schedule, the same tokens per step and epochs.

Its final checkpoint (``<save>/<epoch>/model.safetensors``: ``layers.0.*`` names) is
written as our export directory (``config.json`` + ``model.safetensors`` with
``midlayer.*``, ``d2t``, ``t2d``) so our evaluator decodes with it exactly as with ours.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
from files import write_json


class MetricsTap(logging.Handler):
    """Keeps speculators' metric records (dicts) with the time they were logged."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.records: list[tuple[float, dict]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict):
            self.records.append((time.perf_counter(), record.msg))


def spec_argv(a: argparse.Namespace) -> list[str]:
    return [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", a.target,
        "--data-path", str(a.data),
        "--save-path", str(a.save),
        "--log-dir", str(a.save / "logs"),
        "--draft-vocab-size", str(a.draft_vocab_size),
        "--d2t-path", str(a.data / f"d2t-{a.draft_vocab_size}.npy"),
        "--t2d-path", str(a.data / f"t2d-{a.draft_vocab_size}.npy"),
        "--target-layer-ids", *[str(i) for i in a.aux_layer_ids],
        "--num-layers", "1",
        "--no-norm-before-fc", "--no-norm-output", "--no-norm-before-residual",
        "--full-attention-indices", "0",
        "--ttt-steps", str(a.ttt_steps),
        "--ttt-step-loss-decay", str(a.ttt_decay),
        "--loss-fn", a.loss_fn,
        # Its default fused Triton loss breaks torch 2.11's dynamo inside its compiled forward
        # ("ListVariable ... already tracked for mutation", seen on the H200 run); eager works.
        "--loss-implementation", "eager",
        "--optimizer", a.optimizer,  # muon: Muon over the matrices (its weight decay 0.1, as ours), AdamW the rest
        "--lr", str(a.lr),
        "--weight-decay", "0.0",
        "--scheduler-type", "cosine",
        "--scheduler-warmup-steps", str(a.warmup_steps),
        "--epochs", str(a.epochs),
        "--total-seq-len", str(a.total_seq_len),
        "--train-data-ratio", str(a.train_ratio),
        "--on-missing", "raise",
        "--num-workers", str(a.num_workers),
        "--log-freq", str(a.log_freq),
        "--hidden-states-dtype", "bfloat16",
        "--seed", "0",
        *a.extra,
    ]


def steady_tokens_per_s(records: list[tuple[float, dict]], skip: float = 0.2) -> dict:
    """Throughput between consecutive logged steps, after the first ``skip`` of them (compile, warm-up)."""
    train = [(t, r) for t, r in records if "train" in r and r.get("profile")]
    rates, per_step = [], []
    for (t0, r0), (t1, r1) in itertools.pairwise(train):
        p = r1["profile"]
        tokens = p["tokens_per_s"] * p["step_ms"] / 1000.0
        per_step.append(tokens)
        steps = r1["global_step"] - r0["global_step"]
        if t1 > t0 and steps > 0:
            rates.append(steps * tokens / (t1 - t0))
    kept = rates[int(len(rates) * skip):] or rates
    return {
        "steady_tokens_per_s": round(statistics.median(kept), 1) if kept else None,
        "mean_tokens_per_step": round(statistics.mean(per_step), 1) if per_step else None,
        "logged_steps": len(train),
        "last_step": train[-1][1]["global_step"] + 1 if train else 0,
        "final_train_metrics": train[-1][1]["train"] if train else None,
    }


def merge_parts(earlier: dict | None, part: dict) -> dict:
    """One training's numbers over the calls it took: a run the deadline cut resumes from its last
    checkpoint in the next call, and each call measures only its own part. Wall seconds add up, peak
    memory is the highest part's, steady tokens/s is the parts' mean weighted by their logged steps."""
    keys = ("wall_seconds", "peak_memory_gib", "steady_tokens_per_s", "logged_steps", "last_step")
    before = [] if earlier is None else earlier.get("parts") or [{k: earlier.get(k) for k in keys}]  # one part so far
    parts = [*before, {k: part.get(k) for k in keys}]
    rated = [p for p in parts if p["steady_tokens_per_s"] and p["logged_steps"]]
    weight = sum(p["logged_steps"] for p in rated)
    peaks = [p["peak_memory_gib"] for p in parts if p["peak_memory_gib"] is not None]
    return {**part, "parts": parts,
            "wall_seconds": round(sum(p["wall_seconds"] or 0.0 for p in parts), 1),
            "peak_memory_gib": max(peaks) if peaks else None,
            "steady_tokens_per_s": round(sum(p["steady_tokens_per_s"] * p["logged_steps"] for p in rated) / weight, 1)
            if weight else None,
            "logged_steps": sum(p["logged_steps"] or 0 for p in parts)}


def latest_checkpoint(save: Path) -> Path:
    epochs = sorted((int(p.name), p) for p in save.iterdir() if p.is_dir() and p.name.isdigit())
    if not epochs and (save / "model.safetensors").exists():  # --dry-run saves the initialized drafter here
        return save
    if not epochs or not (epochs[-1][1] / "model.safetensors").exists():
        raise SystemExit(f"speculators left no checkpoint under {save}")
    return epochs[-1][1]


def export_ours(ckpt: Path, target: str, aux_ids: list[int], out: Path) -> dict:
    """speculators checkpoint -> our export dir, by the export stage's own writer (explicit key list, shape-checked)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from eagle3.drafter.adapter import EXPORT_KEYS, midlayer_key
    from eagle3.drafter.model import DrafterConfig
    from eagle3.errors import StageError
    from eagle3.export.directory import write_export

    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        weights = {midlayer_key(k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safetensors handle)
    layer = json.loads((ckpt / "config.json").read_text())["transformer_layer_config"]
    tcfg = AutoConfig.from_pretrained(target)
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    if d2t is None:  # draft vocab = target vocab: speculators keeps no mapping; ours is the identity
        d2t = torch.zeros(tcfg.vocab_size, dtype=torch.int64)  # offsets: draft id i is target id i
        t2d = torch.ones(tcfg.vocab_size, dtype=torch.bool)
    dcfg = DrafterConfig(
        hidden_size=layer["hidden_size"], target_hidden_size=tcfg.hidden_size,
        intermediate_size=layer["intermediate_size"], num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"],
        head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        vocab_size=tcfg.vocab_size, draft_vocab_size=int(d2t.numel()),
        rms_norm_eps=layer["rms_norm_eps"],
        rope_theta=float((layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta", 10000.0))),
        max_position_embeddings=layer["max_position_embeddings"], aux_layer_ids=list(aux_ids),
    )
    try:
        write_export(out, dcfg, weights, d2t, t2d)
    except StageError as e:
        raise SystemExit(f"cannot convert the speculators checkpoint {ckpt}: {e}") from None
    return {"checkpoint": str(ckpt), "ignored_tensors": sorted(set(weights) - set(EXPORT_KEYS))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--save", type=Path, required=True)
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--out-json", type=Path, required=True)
    ap.add_argument("--aux-layer-ids", type=int, nargs=3, required=True)
    ap.add_argument("--draft-vocab-size", type=int, required=True)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--ttt-decay", type=float, default=0.8)
    ap.add_argument("--loss-fn", default="kl_div", help="speculators' --loss-fn (kl_div: its EAGLE-3 default; ce: "
                    "cross-entropy on the target's argmax)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--total-seq-len", type=int, default=16384)
    ap.add_argument("--train-ratio", type=float, default=0.98)
    ap.add_argument("--num-workers", type=int, default=8)
    ap.add_argument("--log-freq", type=int, default=5)
    ap.add_argument("extra", nargs="*", help="more speculators flags, after --")
    a = ap.parse_args(argv)

    from speculators.train.cli import main as spec_main
    from speculators.train.config import TrainConfig

    # On the root logger: speculators' dictConfig clears handlers of its own loggers, and its
    # basicConfig leaves a root that already has handlers alone; metric records propagate here.
    tap = MetricsTap()
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(tap)
    root.addHandler(console)
    sargv = spec_argv(a)
    print("speculators argv: " + " ".join(sargv), flush=True)
    # speculators resumes from a checkpoint under --save: this call is then one part of the training
    resumes = a.save.is_dir() and any(p.is_dir() and p.name.isdigit() for p in a.save.iterdir())
    earlier = json.loads(a.out_json.read_text()) if resumes and a.out_json.is_file() else None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    spec_main(TrainConfig.resolve(sargv))
    wall = time.perf_counter() - t0
    result = merge_parts(earlier, {
        "argv": sargv,
        "wall_seconds": round(wall, 1),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if torch.cuda.is_available() else None,
        **steady_tokens_per_s(tap.records),
    })
    result["export"] = export_ours(latest_checkpoint(a.save), a.target, a.aux_layer_ids, a.export)
    write_json(a.out_json, result)
    print(json.dumps({k: v for k, v in result.items() if k != "argv"}, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
