"""A layer slice of Kimi-K2.5 at its real widths through the ``hf`` extraction path.

The case for ``extract.engine: vllm``: transformers runs Kimi-K2.5's layers (hidden 7168,
MLA with q/kv LoRA ranks 1536/512, 384 routed experts x 2048 with top-8 and one shared
expert, the first layer dense) far below the GPU's bf16 roofline, and the whole model does
not fit a node in bf16 anyway. This builds ``--layers`` decoder layers (layer 0 dense, the
rest MoE; random bf16 weights, ~34 GB per MoE layer: 3 fit an H200 next to the
embedding) and times :func:`eagle3.extract.run.extract_shard` (hooks, batching, the copy to
host), as the extract stage runs it, over ``--tokens`` tokens of random samples.

Reports tokens/s and the share of the bf16 dense roofline (``--peak-tflops``, H200 SXM:
989) that 2 x active parameters per token (+ attention) would use at that rate. Writes
``$OUT/kimi_slice.json`` (or ``--out``).

    python benchmarks/bench_kimi_slice.py --layers 4 --tokens 65536        # on the H200
    python benchmarks/bench_kimi_slice.py --tiny --tokens 256 --out /tmp/k  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

KIMI = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=64,
            num_key_value_heads=64, n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8,
            first_k_dense_replace=1, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, vocab_size=163840, n_group=1, topk_group=1, routed_scaling_factor=2.827,
            norm_topk_prob=True, max_position_embeddings=262144)
TINY = dict(KIMI, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=1024)


def active_params_per_token(c: dict, layers: int) -> dict[str, int]:
    """Parameters a token passes through per layer kind (what its FLOPs scale with)."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attn = (h * c["q_lora_rank"] + c["q_lora_rank"] * heads * qk + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
            + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) + heads * c["v_head_dim"] * h)
    dense = 3 * h * c["intermediate_size"]
    moe = (c["num_experts_per_tok"] + c["n_shared_experts"]) * 3 * h * c["moe_intermediate_size"] + c["n_routed_experts"] * h
    n_moe = max(layers - c["first_k_dense_replace"], 0)
    n_dense = layers - n_moe
    return {"attention": layers * attn, "dense_mlp": n_dense * dense, "moe_active": n_moe * moe,
            "total": layers * attn + n_dense * dense + n_moe * moe}


def attention_flops_per_token(c: dict, layers: int, seq_len: int) -> float:
    """QK^T and AV of causal attention, averaged over positions (mean context seq_len / 2)."""
    heads, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    return layers * 2 * heads * (qk + c["v_head_dim"]) * seq_len / 2


def build(c: dict, layers: int, device: str) -> torch.nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**c, num_hidden_layers=layers, tie_word_embeddings=False)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: 4 Kimi layers are ~100 GB in bf16, twice that in fp32
    try:
        with torch.device(device):
            model = DeepseekV3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    return model.to(dtype).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers: 1 dense + (layers-1) MoE")
    ap.add_argument("--tokens", type=int, default=65536, help="tokens extracted (timed)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak of the GPU (H200 SXM: 989)")
    ap.add_argument("--tiny", action="store_true", help="tiny widths on CPU (smoke test)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    from eagle3.generate.tokenized import from_lists
    from eagle3.extract.batching import plan_shards
    from eagle3.targets.capture import HiddenCapture, find_decoder_stack
    from eagle3.extract.run import ShardStats, extract_shard

    c = TINY if args.tiny else KIMI
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    t0 = time.perf_counter()
    model = build(c, args.layers, device)
    build_s = time.perf_counter() - t0
    n = max(args.tokens // args.seq_len, 1)
    g = torch.Generator().manual_seed(0)
    samples = [(i, torch.randint(0, c["vocab_size"], (args.seq_len,), generator=g).tolist(), [1] * args.seq_len)
               for i in range(n + 1)]  # one more for warm-up
    data = from_lists(samples)
    plans = plan_shards(data.lengths(), args.seq_len)  # one sample per plan: first warms up
    aux = [0, max(args.layers // 2, 1), args.layers - 1]
    stack = find_decoder_stack(model, args.layers)
    stats = ShardStats()
    with HiddenCapture(stack, aux) as capture:
        extract_shard(capture, data, plans[0], c["hidden_size"], args.batch_tokens, "bfloat16", ShardStats())
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for p in plans[1:]:
            extract_shard(capture, data, p, c["hidden_size"], args.batch_tokens, "bfloat16", stats)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    tokens = stats.real_tokens
    active = active_params_per_token(c, args.layers)
    flops_per_token = 2 * active["total"] + attention_flops_per_token(c, args.layers, args.seq_len)
    tps = tokens / wall
    result = {
        "what": "Kimi-K2.5 layer slice (real widths) through the hf extraction path (extract_shard)",
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "layers": args.layers, "moe_layers": max(args.layers - c["first_k_dense_replace"], 0),
        "widths": {k: c[k] for k in ("hidden_size", "n_routed_experts", "moe_intermediate_size",
                                     "num_experts_per_tok", "n_shared_experts", "q_lora_rank", "kv_lora_rank")},
        "parameters": sum(p.numel() for p in model.parameters()),
        "active_parameters_per_token": active,
        "tokens": tokens, "seq_len": args.seq_len, "batch_tokens": args.batch_tokens,
        "wall_s": round(wall, 3), "build_s": round(build_s, 1), "tokens_per_s": round(tps, 1),
        "achieved_tflops": float(f"{tps * flops_per_token / 1e12:.4g}"),
        "peak_bf16_tflops": args.peak_tflops,
        "roofline_share": float(f"{tps * flops_per_token / (args.peak_tflops * 1e12):.4g}"),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if device == "cuda" else None,
        "transformers": __import__("transformers").__version__, "torch": torch.__version__,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kimi_slice.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
