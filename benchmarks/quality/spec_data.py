"""Write our generate stage's samples as a vllm-project/speculators training data dir.

speculators (0.9) trains from ``<data>/``: a ``datasets`` dataset saved with
``save_to_disk`` (columns ``input_ids``, ``loss_mask``, ``seq_len``, torch format, as its
``prepare_data`` writes for pre-tokenized rows) and ``<data>/hidden_states/hs_<i>.safetensors``
per sample (``hidden_states`` [T, 4, H]: the three aux layers then the last decoder
layer's output *before* the final norm, as vLLM's hidden-state connector writes them;
``token_ids`` [T]). Its generator needs vLLM, which the benchmark machine lacks, so this
script computes the same four tensors with the HF target through the extract stage's own
capture (hooks on the inputs of the aux decoder layers and of the final norm) on exactly our
tokenized samples. The
draft vocab is ours too (``d2t-<N>.npy`` / ``t2d-<N>.npy``), so both systems train the
same drafter shape on the same tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file


@torch.no_grad()
def write_hidden_states(model, samples, aux_ids: list[int], out_dir: Path, device: torch.device,
                        batch_tokens: int = 65536) -> dict:
    """hs_<i>.safetensors for every sample i, through the extract stage's own capture (hooks on the
    decoder stack, batches of similar length, right-padded), keeping the final norm's input."""
    from eagle3.extract.batching import plan_batches, right_pad
    from eagle3.targets.capture import HiddenCapture, find_decoder_stack
    from eagle3.targets.load import num_layers

    out_dir.mkdir(parents=True, exist_ok=True)
    lengths = samples.lengths().tolist()
    t0, tokens, written = time.monotonic(), 0, 0
    stack = find_decoder_stack(model, num_layers(model.config))
    with HiddenCapture(stack, aux_ids, final_normed=False) as capture:
        for batch in plan_batches(lengths, batch_tokens):
            ids, _ = right_pad([samples.sample(s)[0] for s in batch])
            aux, last = capture.run_stack(ids.to(device))
            stacked = torch.stack([*aux, last], dim=2).to(torch.bfloat16).cpu()  # [B, W, 4, H]
            for r, s in enumerate(batch):
                n = lengths[s]
                save_file({"hidden_states": stacked[r, :n].contiguous(), "token_ids": ids[r, :n].clone()},
                          str(out_dir / f"hs_{s}.safetensors"))
                tokens += n
                written += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.monotonic() - t0
    return {"samples": written, "tokens": tokens, "seconds": round(dt, 2), "tokens_per_s": round(tokens / max(dt, 1e-9))}


def write_dataset(samples, out_dir: Path) -> None:
    import hashlib

    import pyarrow as pa
    from datasets import Dataset

    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i in range(len(samples)):
        x, m = samples.sample(i)
        rows["input_ids"].append(x.long().tolist())
        rows["loss_mask"].append(m.long().tolist())
        rows["seq_len"].append(int(x.numel()))
    # An explicit fingerprint: datasets otherwise hashes the table with dill, which fails on
    # some pyarrow/dill version pairs (pyarrow 26's MonthDayNano type) for no benefit here.
    fingerprint = hashlib.sha256(samples.input_ids.numpy().tobytes()).hexdigest()[:16]
    ds = Dataset(pa.table(rows), fingerprint=fingerprint)
    ds.set_format(type="torch")
    ds.save_to_disk(str(out_dir))


def write_vocab(d2t: torch.Tensor, t2d: torch.Tensor, out_dir: Path) -> tuple[Path, Path]:
    n = d2t.numel()
    d2t_path, t2d_path = out_dir / f"d2t-{n}.npy", out_dir / f"t2d-{n}.npy"
    np.save(d2t_path, d2t.cpu().numpy())
    np.save(t2d_path, t2d.cpu().numpy())
    return d2t_path, t2d_path


def make_spec_data(target_dir: str, tokenized_path: Path, vocab_path: Path, aux_ids: list[int], out_dir: Path,
                   device: torch.device) -> dict:
    from transformers import AutoModelForCausalLM

    from eagle3.data.tokenized import read_tokenized
    from eagle3.vocab.mapping import load_vocab_mapping

    samples = read_tokenized(tokenized_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_dataset(samples, out_dir)
    d2t, t2d = load_vocab_mapping(vocab_path)
    d2t_path, t2d_path = write_vocab(d2t, t2d, out_dir)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    stats = write_hidden_states(model, samples, aux_ids, out_dir / "hidden_states", device)
    return {**stats, "d2t_path": str(d2t_path), "t2d_path": str(t2d_path), "draft_vocab_size": int(d2t.numel())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--tokenized", type=Path, required=True, help="generate stage's tokenized.safetensors")
    ap.add_argument("--vocab", type=Path, required=True, help="vocab stage's vocab_mapping.safetensors")
    ap.add_argument("--aux-layer-ids", type=int, nargs=3, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    stats = make_spec_data(args.target, args.tokenized, args.vocab, args.aux_layer_ids, args.out, torch.device(args.device))
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
