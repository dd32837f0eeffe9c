"""speculators' side of the race (vllm-project/speculators 0.9.0): our samples in its data format, its own
trainer, and its drafter written as our export directory.

``data``: speculators trains from ``<data>/``: a ``datasets`` dataset saved with ``save_to_disk``
(``input_ids``, ``loss_mask``, ``seq_len``, as its ``prepare_data`` writes pre-tokenized rows),
``hidden_states/hs_<i>.safetensors`` per sample (``hidden_states`` [T, 4, H]: the three aux layers
then the last decoder layer's output before the final norm, as vLLM's hidden-state connector
writes them; ``token_ids`` [T]) and the draft vocab (``d2t-<N>.npy``, ``t2d-<N>.npy``). Its
generator needs vLLM, so the same four tensors are computed here by the extract stage's own capture
on exactly the generate stage's samples, with the target loaded as the race serves it; the draft
vocab is the vocab stage's, so both systems train the same drafter shape on the same tokens.

``train``: speculators' own entry point (``speculators.train.cli.main``, what ``python -m
speculators.train`` runs) in this process, timed by a logging handler on the root logger (where
its metric records propagate) and ``torch.cuda.max_memory_allocated``. Its trainer needs a GPU;
on a CPU it runs ``--dry-run`` (its drafter built and saved untrained). Its last checkpoint
(``layers.0.*`` names) is written as our export directory by the export stage's own writer, so
our evaluators decode it exactly as ours.

Run as ``python -m benchmarks.quality.speculators_side {data,train}``; each writes its result last, whole.
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

import numpy as np
import torch
from safetensors.torch import save_file

from benchmarks.quality.files import write_json


def speculators_missing() -> str | None:
    """Why speculators' side cannot run in this Python (None: it can)."""
    try:
        import datasets  # noqa: F401
        import speculators.train.cli  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the reason, said in one line
        return f"speculators 0.9.0 and datasets are not importable ({type(e).__name__}: {e})"
    return None


# -- data ----------------------------------------------------------------------------------------


@torch.no_grad()
def write_hidden_states(model, samples, aux_ids: list[int], out: Path, batch_tokens: int = 65536) -> int:
    """hs_<i>.safetensors for every sample i, through the extract stage's capture (hooks on the decoder stack,
    batches of similar length, right-padded), keeping the final norm's input; returns the tokens written."""
    from eagle3.extract.batching import plan_batches, right_pad
    from eagle3.targets.capture import HiddenCapture, find_decoder_stack
    from eagle3.targets.load import num_layers

    out.mkdir(parents=True, exist_ok=True)
    lengths, tokens = samples.lengths().tolist(), 0
    device = next(model.parameters()).device
    with HiddenCapture(find_decoder_stack(model, num_layers(model.config)), aux_ids, final_normed=False) as capture:
        for batch in plan_batches(lengths, batch_tokens):
            ids, _ = right_pad([samples.sample(s)[0] for s in batch])
            aux, last = capture.run_stack(ids.to(device))
            stacked = torch.stack([*aux, last], dim=2).to(torch.bfloat16).cpu()  # [B, W, 4, H]
            for row, s in enumerate(batch):
                n = lengths[s]
                save_file({"hidden_states": stacked[row, :n].contiguous(), "token_ids": ids[row, :n].clone()},
                          str(out / f"hs_{s}.safetensors"))
                tokens += n
    return tokens


def write_dataset(samples, out: Path) -> None:
    import hashlib

    import pyarrow as pa
    from datasets import Dataset

    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i in range(len(samples)):
        x, m = samples.sample(i)
        rows["input_ids"].append(x.long().tolist())
        rows["loss_mask"].append(m.long().tolist())
        rows["seq_len"].append(int(x.numel()))
    # an explicit fingerprint: datasets otherwise hashes the table with dill, which fails on some pyarrow/dill pairs
    fingerprint = hashlib.sha256(samples.input_ids.numpy().tobytes()).hexdigest()[:16]
    ds = Dataset(pa.table(rows), fingerprint=fingerprint)
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))


def write_data(config: Path, tokenized: Path, vocab_mapping: Path, aux_ids: list[int], out: Path) -> dict:
    from eagle3.config import load_config
    from eagle3.generate.tokenized import read_tokenized
    from eagle3.targets.load import load_target_model
    from eagle3.vocab.mapping import load_vocab_mapping

    cfg = load_config(config)
    samples = read_tokenized(tokenized)
    write_dataset(samples, out)
    d2t, t2d = load_vocab_mapping(vocab_mapping)
    np.save(out / f"d2t-{d2t.numel()}.npy", d2t.numpy())
    np.save(out / f"t2d-{d2t.numel()}.npy", t2d.numpy())
    model = load_target_model(cfg.target, "cuda" if torch.cuda.is_available() else "cpu")
    tokens = write_hidden_states(model, samples, aux_ids, out / "hidden_states")
    return {"samples": len(samples), "tokens": tokens, "draft_vocab_size": int(d2t.numel())}


# -- training ------------------------------------------------------------------------------------


class MetricsTap(logging.Handler):
    """Keeps speculators' metric records (dicts) with the time they were logged."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.records: list[tuple[float, dict]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict):
            self.records.append((time.perf_counter(), record.msg))


def steady_rate(records: list[tuple[float, dict]], skip: float = 0.2) -> dict:
    """Tokens/s between consecutive logged training steps, the median after the first ``skip`` of them
    (compile, warm-up), and the mean tokens per step."""
    train = [(t, r) for t, r in records if "train" in r and r.get("profile")]
    rates, per_step = [], []
    for (t0, r0), (t1, r1) in itertools.pairwise(train):
        p = r1["profile"]
        tokens = p["tokens_per_s"] * p["step_ms"] / 1000.0
        per_step.append(tokens)
        if t1 > t0 and r1["global_step"] > r0["global_step"]:
            rates.append((r1["global_step"] - r0["global_step"]) * tokens / (t1 - t0))
    kept = rates[int(len(rates) * skip):] or rates
    return {"steady_tokens_per_s": round(statistics.median(kept), 1) if kept else None,
            "mean_tokens_per_step": round(statistics.mean(per_step), 1) if per_step else None,
            "logged_steps": len(train)}


def checkpoints(save: Path) -> list[tuple[int, Path]]:
    """speculators' checkpoints under ``save`` (``<epoch>/`` with training_state.json) by global step; its
    ``--dry-run`` saves the untrained drafter in ``save`` itself (step 0)."""
    found = []
    for state in save.glob("[0-9]*/training_state.json"):
        if (state.parent / "model.safetensors").exists():
            found.append((int(json.loads(state.read_text())["global_step"]), state.parent))
    if not found and (save / "model.safetensors").exists():
        found.append((0, save))
    return sorted(found)


def export_ours(ckpt: Path, target: str, aux_ids: list[int], out: Path) -> dict:
    """A speculators checkpoint as our export directory, by the export stage's writer (explicit key list)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from eagle3.drafter.adapter import EXPORT_KEYS, midlayer_key
    from eagle3.drafter.model import DrafterConfig
    from eagle3.export.directory import write_export

    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        weights = {midlayer_key(k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safetensors handle)
    layer = json.loads((ckpt / "config.json").read_text())["transformer_layer_config"]
    tcfg = AutoConfig.from_pretrained(target)
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    if d2t is None:  # draft vocab = target vocab: speculators keeps no mapping; ours is the identity
        d2t, t2d = torch.zeros(tcfg.vocab_size, dtype=torch.int64), torch.ones(tcfg.vocab_size, dtype=torch.bool)
    rope = layer.get("rope_parameters") or {}
    dcfg = DrafterConfig(
        hidden_size=layer["hidden_size"], target_hidden_size=tcfg.hidden_size,
        intermediate_size=layer["intermediate_size"], num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"],
        head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        vocab_size=tcfg.vocab_size, draft_vocab_size=int(d2t.numel()), rms_norm_eps=layer["rms_norm_eps"],
        rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
        max_position_embeddings=layer["max_position_embeddings"], aux_layer_ids=list(aux_ids))
    write_export(out, dcfg, weights, d2t, t2d)
    return {"checkpoint": str(ckpt), "ignored_tensors": sorted(set(weights) - set(EXPORT_KEYS))}


def train(argv: list[str], export: Path) -> dict:
    """speculators' trainer on ``argv`` (resuming from a checkpoint under its save path), timed; then its last
    checkpoint exported to ``export``."""
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    if not torch.cuda.is_available():  # its trainer needs a GPU: build and save its drafter, untrained
        argv = [*argv, "--draft-attn-impl", "sdpa", "--dry-run"]
    paths = argparse.ArgumentParser(add_help=False)
    paths.add_argument("--save-path", type=Path)
    paths.add_argument("--verifier-name-or-path")
    paths.add_argument("--target-layer-ids", type=int, nargs=3)
    known, _ = paths.parse_known_args(argv)
    tap = MetricsTap()  # on the root logger: speculators' dictConfig clears its own loggers' handlers
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(tap)
    root.addHandler(logging.StreamHandler(sys.stderr))
    resumed = [s for s, p in checkpoints(known.save_path) if p != known.save_path] if known.save_path.is_dir() else []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    speculators_main(TrainConfig.resolve(argv))
    wall = time.perf_counter() - t0
    step, ckpt = checkpoints(known.save_path)[-1]
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 3) if torch.cuda.is_available() else None
    return {"final_step": step, "resumed_from_step": resumed[-1] if resumed else None, "wall_seconds": round(wall, 1),
            "peak_memory_gib": peak,
            **steady_rate(tap.records), "dry_run": "--dry-run" in argv, "argv": argv,
            **export_ours(ckpt, known.verifier_name_or_path, known.target_layer_ids, export), "export": str(export)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("data", help="our samples and hidden states in speculators' format")
    d.add_argument("--config", type=Path, required=True, help="the race's pipeline config (its target and dtype)")
    d.add_argument("--tokenized", type=Path, required=True, help="the generate stage's tokenized.safetensors")
    d.add_argument("--vocab-mapping", type=Path, required=True, help="the vocab stage's vocab_mapping.safetensors")
    d.add_argument("--aux-layer-ids", type=int, nargs=3, required=True)
    d.add_argument("--out", type=Path, required=True, help="speculators' data folder")
    t = sub.add_parser("train", help="speculators' trainer, then its drafter as our export directory")
    t.add_argument("--export", type=Path, required=True)
    for p in (d, t):
        p.add_argument("--result", type=Path, required=True, help="where the JSON result goes, written last")
    t.add_argument("argv", nargs=argparse.REMAINDER, help="speculators' flags, after --")
    a = ap.parse_args(argv)
    if a.command == "data":
        result = {**write_data(a.config, a.tokenized, a.vocab_mapping, a.aux_layer_ids, a.out), "paths": [str(a.out)]}
    else:
        result = train([x for x in a.argv if x != "--"], a.export)
        result["paths"] = [str(a.export)]
    write_json(a.result, result)


if __name__ == "__main__":
    main()
