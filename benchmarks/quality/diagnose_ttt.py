"""Where training-time accuracy and decoding part ways: one trained drafter, three views of
its held-out samples.

The train stage reports accuracy per TTT step with teacher forcing (every step fed the
true tokens); the evaluate stage reports acceptance per draft position, each conditional
on the drafts before it. When the two disagree, this script tells which side moved:

- ``ttt``: the TTT forward as the train stage's held-out evaluation runs it (SDPA, the
  drafter in float32 under bf16 autocast on CUDA). Per step: accuracy (argmax of the draft
  head equals the teacher's argmax over the draft vocab), and the *chained* conditional
  accuracy — step k right given steps 0..k-1 right at the same row — which is what the
  evaluate stage's conditional acceptance measures.
- ``ttt_bf16``: the same forward with the drafter's weights in bf16 and no autocast, as
  the evaluate stage loads it.
- ``decode``: token-by-token drafting with the decoding KV cache (``KVCache``, what
  ``SpeculativeDecoder`` uses): the sample's rows 0..t prefilled, then the chain fed the
  true tokens, one position further per step. Per step: accuracy, chained conditional,
  and agreement with ``ttt_bf16``'s argmax at the same row and step.

If ``decode`` agrees with ``ttt_bf16``, the forward passes match and a gap to the
evaluate stage comes from elsewhere (its prompts, or what the model learned); if the
chained conditional is low here too, the drafter itself learned it.

    python benchmarks/quality/diagnose_ttt.py --store /tmp/e3q/store --run q-bf16 --out diag.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eagle3.drafter.adapter import load_drafter
from eagle3.drafter.loss import chain_rates, chain_sums, counted_rows, shift_left, step_inputs
from eagle3.drafter.model import Eagle3Drafter, KVCache, TTTCache
from eagle3.extract.shards import INDEX, TARGET_HEAD, read_shard
from eagle3.train.data import Batch, DataPlan, shard_refs
from eagle3.train.stage import load_target_head
from eagle3.vocab.mapping import draft_to_target, load_vocab_mapping


def held_out_batches(store: Path, run: str, a: argparse.Namespace, dtype: torch.dtype) -> tuple[str, list[Batch]]:
    """The train stage's held-out batches (same split: sample-id hash with its seed and fraction);
    training batches where the run holds none out (tiny smoke runs) → (split, batches)."""
    index = json.loads((store / run / "extract" / INDEX).read_text())
    plan = DataPlan(shard_refs(index), a.batch_tokens, a.max_seq_len, a.eval_fraction, a.seed, 0, 1)
    for split in ("heldout", "train"):
        out = []
        for b in plan.iterate(lambda name: read_shard(store / run / "extract" / name), 0, dtype, train=split == "train"):
            out.append(b)
            if len(out) >= a.max_batches:
                break
        if out:
            return split, out
    raise SystemExit(f"diagnose: no samples in {store / run}")


def gold_per_step(teacher_head: torch.Tensor, b: Batch, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gold [S, B, T] teacher argmax for step k at row t = argmax z_{t+1+k}; counted [S, B, T] bool)."""
    with torch.no_grad():
        z = b.final_hidden.to(teacher_head.dtype) @ teacher_head.T  # [B, T, N]
        top = z.argmax(-1)  # [B, T]
    gold = torch.stack([shift_left(top, 1 + k) for k in range(steps)])
    counted = torch.stack([counted_rows(b.loss_mask, k) for k in range(steps)])
    return gold, counted


def _rms(x: torch.Tensor, rows: torch.Tensor) -> float:
    """Root mean square over the selected rows [B, T] of x [B, T, H]."""
    return float(x.float()[rows].pow(2).mean().sqrt()) if rows.any() else float("nan")


@torch.no_grad()
def ttt_argmax(drafter: Eagle3Drafter, b: Batch, steps: int, autocast: bool,
               scales: dict[str, list[float]] | None = None) -> torch.Tensor:
    """[S, B, T] draft argmax per TTT step (SDPA attention, teacher forcing). ``scales``
    (optional) gets, over real rows (loss-masked or a non-zero token id: padding is id 0, so
    this is approximate), the aux inputs' and fc output's RMS, and per step the RMS of the
    hidden fed in and of what the layer adds to it."""
    cache = TTTCache("sdpa")
    preds = []
    real = b.loss_mask.bool() | (b.input_ids != 0)
    with torch.autocast(b.aux_hidden.device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = drafter.project_aux(b.aux_hidden)
        if scales is not None:
            scales.setdefault("aux_rms", []).append(_rms(b.aux_hidden, real))
            scales.setdefault("fc_out_rms", []).append(_rms(hidden, real))
        for k in range(steps):
            tokens, positions, _ = step_inputs(b.input_ids, b.loss_mask, k)
            before = hidden
            hidden = drafter.step_hidden(tokens, hidden, positions, cache)
            if scales is not None:
                scales.setdefault(f"hidden_in_rms_{k}", []).append(_rms(before, real))
                scales.setdefault(f"layer_delta_rms_{k}", []).append(_rms(hidden.float() - before.float(), real))
            preds.append(drafter.logits(hidden).argmax(-1))
    return torch.stack(preds)


@torch.no_grad()
def decode_argmax(drafter: Eagle3Drafter, b: Batch, steps: int, rows: list[tuple[int, int]]) -> torch.Tensor:
    """[S, R] draft argmax of token-by-token drafting at the given (sample, row t) pairs."""
    dtype = drafter.fc.weight.dtype
    out = torch.zeros(steps, len(rows), dtype=torch.long, device=b.input_ids.device)
    prefilled: dict[int, tuple[KVCache, torch.Tensor, torch.Tensor]] = {}
    for r, (i, t) in enumerate(rows):
        if i not in prefilled:
            n = int(b.loss_mask[i].numel())
            cache = KVCache()
            tokens = shift_left(b.input_ids[i : i + 1], 1)
            positions = torch.arange(n, device=tokens.device)[None]
            hidden, logits, _ = drafter.step(tokens, drafter.project_aux(b.aux_hidden[i : i + 1].to(dtype)), positions, cache)
            prefilled[i] = (cache, hidden, logits.argmax(-1))
        full, hidden_all, first = prefilled[i]
        cache = KVCache()
        cache.k, cache.v = full.k[:, :, : t + 1], full.v[:, :, : t + 1]  # rows 0..t: what decoding has cached
        out[0, r] = first[0, t]
        hidden = hidden_all[:, t : t + 1]
        for j in range(1, steps):
            token = b.input_ids[i : i + 1, t + 1 + j : t + 2 + j]
            position = torch.tensor([[t + j]], device=token.device)
            hidden, logits, _ = drafter.step(token, hidden, position, cache)
            out[j, r] = logits[0, -1].argmax()
    return out


def per_step(hits: torch.Tensor, counted: torch.Tensor, preds: torch.Tensor) -> dict[str, list[float]]:
    """hits/counted [S, R] bool, preds [S, R] → teacher-forced accuracy, chained accuracy (the train
    stage's own :func:`chain_sums`) and the share of rows repeating step 0's argmax, per step."""
    acc = [float(hits[k][counted[k]].float().mean()) if counted[k].any() else float("nan") for k in range(hits.shape[0])]
    chained, same = chain_rates(chain_sums(hits, counted, preds))
    return {"accuracy": [round(x, 4) for x in acc], "chained_conditional": [round(x, 4) for x in chained],
            "same_argmax_as_step0": [round(x, 4) for x in same]}


def diagnose(store: Path, run: str, a: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and a.device != "cpu" else "cpu")
    bf16 = device.type == "cuda"
    d2t, _ = load_vocab_mapping(store / run / "vocab" / "vocab_mapping.safetensors")
    embed, teacher = load_target_head(store / run / "extract" / TARGET_HEAD, draft_to_target(d2t))
    weights = Path(a.drafter) if a.drafter else store / run / "train" / "drafter.safetensors"
    drafter = load_drafter(weights, embed).to(device).eval()
    drafter_low = copy.deepcopy(drafter).to(torch.bfloat16 if bf16 else torch.float32)  # as evaluate loads it
    teacher = teacher.to(device, torch.bfloat16 if bf16 else torch.float32)
    s = a.steps
    views: dict[str, dict[str, list]] = {}
    hits: dict[str, list[torch.Tensor]] = {"ttt": [], "ttt_bf16": [], "decode": [], "agree": []}
    preds: dict[str, list[torch.Tensor]] = {"ttt": [], "ttt_bf16": [], "decode": []}
    counted_all, decode_counted = [], []
    scales: dict[str, list[float]] = {}
    gen = torch.Generator().manual_seed(0)
    split, batches = held_out_batches(store, run, a, torch.bfloat16 if bf16 else torch.float32)
    for hb in batches:
        b = hb.to(device)
        gold, counted = gold_per_step(teacher, b, s)
        ttt = ttt_argmax(drafter, b, s, autocast=bf16, scales=scales)
        low = ttt_argmax(drafter_low, b, s, autocast=False)
        for view, p in (("ttt", ttt), ("ttt_bf16", low)):
            hits[view].append((p == gold).flatten(1))
            preds[view].append(p.flatten(1))
        counted_all.append(counted.flatten(1))
        # Decode rows: counted at every step (an assistant stretch of s+1 tokens ahead), a few per sample.
        every = counted.all(0)  # [B, T]
        rows = []
        for i in range(b.input_ids.shape[0]):
            ts = every[i].nonzero().squeeze(-1).cpu()
            if ts.numel():
                pick = ts[torch.randperm(ts.numel(), generator=gen)[: a.rows_per_sample]]
                rows += [(i, int(t)) for t in pick.sort().values]
        if rows:
            dec = decode_argmax(drafter_low, b, s, rows)
            ii = torch.tensor([r[0] for r in rows], device=device)
            tt = torch.tensor([r[1] for r in rows], device=device)
            hits["decode"].append(dec == gold[:, ii, tt])
            hits["agree"].append(dec == low[:, ii, tt])
            preds["decode"].append(dec)
            decode_counted.append(counted[:, ii, tt])
    c = torch.cat(counted_all, 1)
    for view in ("ttt", "ttt_bf16"):  # a chain that does not advance repeats step 0's argmax at every step
        views[view] = per_step(torch.cat(hits[view], 1), c, torch.cat(preds[view], 1))
    if decode_counted:
        dc = torch.cat(decode_counted, 1)
        views["decode"] = per_step(torch.cat(hits["decode"], 1), dc, torch.cat(preds["decode"], 1))
        agree = torch.cat(hits["agree"], 1)
        views["decode"]["agrees_with_ttt_bf16"] = [round(float(agree[k].float().mean()), 4) for k in range(s)]
        views["decode"]["rows"] = int(dc.shape[1])
    views["ttt"]["rows_counted_step0"] = int(c[0].sum())
    mean_scales = {k: round(sum(v) / len(v), 4) for k, v in scales.items()}
    return {"run": run, "drafter": str(weights), "device": device.type, "samples": split, "views": views,
            "scales": mean_scales}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, required=True, help="the file store's root (store.uri file://...)")
    ap.add_argument("--run", required=True, help="run id whose vocab, extract and train stages are read")
    ap.add_argument("--drafter", default=None, help="drafter.safetensors (default: the run's train stage)")
    ap.add_argument("--steps", type=int, default=7, help="TTT steps / draft positions")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--eval-fraction", type=float, default=0.02, help="the train stage's train.eval_fraction")
    ap.add_argument("--seed", type=int, default=0, help="the train stage's train.seed")
    ap.add_argument("--max-batches", type=int, default=8)
    ap.add_argument("--rows-per-sample", type=int, default=8, help="rows drafted token by token per sample")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    result = diagnose(a.store, a.run, a)
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
