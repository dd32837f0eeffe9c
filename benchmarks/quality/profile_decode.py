"""Where speculative decoding's time goes, on a random target of the quality benchmark's shape.

    python benchmarks/quality/profile_decode.py --out DIR [--batch 16] [--new-tokens 128]

No trained weights needed: a random Llama of make_target's recipe (130M, 64K vocab) and a
random drafter (16K draft vocab). Random drafts are all rejected, so every round emits one
token: the most rounds, the worst case per token. Times, with the GPU synchronised: the
target's creation, one batched decode of ``--batch`` prompts (the evaluate stage's
batch_size) and one prompt decoded alone, each also with one new token only (its prefill,
so that ms per round leaves the prefill out), one plain greedy decode (the greedy check);
then one batched decode under torch.profiler. Writes ``DIR/decode_profile.json`` and
``DIR/decode_profile.txt`` (top ops by CPU and CUDA time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]


def timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, round(time.perf_counter() - t0, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--draft-tokens", type=int, default=7)
    ap.add_argument("--small", action="store_true", help="make_target's tiny recipe (CPU smoke test)")
    ap.add_argument("--draft-vocab", type=int, default=None, help="default 16384 (512 with --small)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    from types import SimpleNamespace

    from make_target import TINY, TargetRecipe, build_model

    from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3.drafter.settings import DrafterSettings
    from eagle3.evaluate.batched import BatchedSpeculativeDecoder
    from eagle3.evaluate.spec_decode import SpeculativeDecoder, greedy_generate
    from eagle3.extract.capture import HiddenCapture, find_decoder_stack
    from eagle3.targets.aux_layers import default_aux_layer_ids

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    recipe = TINY if a.small else TargetRecipe()  # make_target.py's shapes, random weights
    draft_vocab = a.draft_vocab or (512 if a.small else 16384)  # run_quality.py's defaults
    torch.manual_seed(0)
    res: dict = {"device": str(device), "batch": a.batch, "new_tokens": a.new_tokens, "draft_tokens": a.draft_tokens}
    special = SimpleNamespace(bos_token_id=0, eos_token_id=1, pad_token_id=2)  # no tokenizer needed
    target, res["target_create_s"] = timed(lambda: build_model(recipe, special).to(device=device, dtype=dtype).eval(),
                                           device)
    n = recipe.num_layers
    aux = default_aux_layer_ids(n)
    dcfg = DrafterConfig.from_target(target.config, DrafterSettings(), draft_vocab, aux)
    drafter = Eagle3Drafter(dcfg)
    drafter.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.float())
    drafter = drafter.to(device=device, dtype=dtype).eval()
    d2t = torch.zeros(draft_vocab, dtype=torch.long)  # draft i -> target i
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, recipe.vocab_size, (a.prompt_tokens + 7 * i,), generator=g).tolist()
               for i in range(a.batch)]
    eos = {-1}  # never: every prompt runs its full new_tokens
    with HiddenCapture(find_decoder_stack(target, n), aux) as capture:
        seq = SpeculativeDecoder(target, capture, drafter, d2t, a.draft_tokens, eos)
        bat = BatchedSpeculativeDecoder(target, capture, drafter, d2t, a.draft_tokens, eos)
        res["batched_fallback_reason"] = bat.fallback_reason
        _, res["warmup_s"] = timed(lambda: bat.generate_batch(prompts[:2], 8), device)
        _, res["batched_prefill_s"] = timed(lambda: bat.generate_batch(prompts, 1), device)  # the prefill: its bonus token is the one new token
        out, res["batched_s"] = timed(lambda: bat.generate_batch(prompts, a.new_tokens), device)
        res["batched_rounds"] = max(r.steps for r in out)
        res["batched_ms_per_round"] = round(1000 * (res["batched_s"] - res["batched_prefill_s"])
                                            / max(1, res["batched_rounds"]), 2)
        _, res["single_prefill_s"] = timed(lambda: seq.generate(prompts[0], 1), device)
        one, res["single_prompt_s"] = timed(lambda: seq.generate(prompts[0], a.new_tokens), device)
        res["single_ms_per_round"] = round(1000 * (res["single_prompt_s"] - res["single_prefill_s"])
                                           / max(1, one.steps), 2)
        _, res["greedy_one_prompt_s"] = timed(lambda: greedy_generate(target, prompts[0], a.new_tokens, eos), device)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=acts) as prof:
            bat.generate_batch(prompts, min(a.new_tokens, 32))
    ka = prof.key_averages()
    text = ["# by self CPU time", ka.table(sort_by="self_cpu_time_total", row_limit=35)]
    if device.type == "cuda":
        text += ["# by CUDA time", ka.table(sort_by="cuda_time_total", row_limit=35)]
    (a.out / "decode_profile.txt").write_text("\n".join(text))
    (a.out / "decode_profile.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
