"""Extraction throughput against a plain forward pass of the same target, same batches.

Self-contained: targets are built from config with random weights (no hub). Measures,
per target, in one process:

- plain:    ``model.model(input_ids)`` (decoder stack, no hooks, no lm_head), tokens/s
- extract:  the extract stage's own code (hooks, real-token selection, dtype conversion,
            device-to-host copy, shard assembly), tokens/s; goal >= 0.9 x plain
- write:    the same plus streaming each shard (safetensors) into a local file:// store
            through StageOutput (sha256 on the way) on the stage's writer thread,
            overlapped with the next shard's extraction, tokens/s
- bytes per token of the shards in bfloat16 and float8_e4m3fn

Run on one H200:  python benchmarks/bench_extract.py --out bench_extract.json
On CPU (smoke):   python benchmarks/bench_extract.py --tiny --out /tmp/bench.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from eagle3.generate.tokenized import from_lists
from eagle3.extract.batching import plan_batches, plan_shards, right_pad
from eagle3.targets.capture import HiddenCapture, find_decoder_stack
from eagle3.extract.run import HostStaging, ShardStats, extract_shard
from eagle3.extract.writer import ShardWriter
from eagle3.manifest import StageOutput
from eagle3.store.local import LocalStore
from eagle3.targets.aux_layers import default_aux_layer_ids


def llama_8b_config(tiny: bool) -> Any:
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    # Llama-3.1-8B's shape.
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def deepseek_small_config(tiny: bool) -> Any:
    from transformers import DeepseekV3Config

    if tiny:
        return DeepseekV3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                                qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                                num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                moe_intermediate_size=32, first_k_dense_replace=1)
    # Kimi-K2.5's architecture (MLA + MoE, its vocab) at ~9.6B parameters (16 layers, 64 experts) so it fits one GPU.
    return DeepseekV3Config(vocab_size=163840, hidden_size=2048, intermediate_size=11264, num_hidden_layers=16,
                            num_attention_heads=16, num_key_value_heads=16, q_lora_rank=1536, kv_lora_rank=512,
                            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64,
                            num_experts_per_tok=6, n_group=1, topk_group=1, n_shared_experts=2,
                            moe_intermediate_size=1408, first_k_dense_replace=1, routed_scaling_factor=2.5,
                            max_position_embeddings=16384, tie_word_embeddings=False)


def build_model(config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with device:  # initialise on the GPU: random init of 8B parameters on CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def random_samples(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[int, list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append((i, ids, [1] * length))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def plain_forward(model: Any, data: Any, shards: list[Any], batch_tokens: int, device: torch.device) -> float:
    """Seconds for the decoder stack alone over the same batches extraction uses."""
    stack = find_decoder_stack(model, model.config.num_hidden_layers)
    total = 0.0
    for p in shards:
        offsets = data.offsets[p.first : p.end + 1]
        lengths = (offsets[1:] - offsets[:-1]).tolist()
        for batch in plan_batches(lengths, batch_tokens):
            ids, _ = right_pad([data.input_ids[int(offsets[j]) : int(offsets[j + 1])] for j in batch])
            ids = ids.to(device)
            sync(device)
            t0 = time.perf_counter()
            stack.base(input_ids=ids, use_cache=False)
            sync(device)
            total += time.perf_counter() - t0
    return total


def extract_all(model: Any, data: Any, shards: list[Any], batch_tokens: int, storage: str,
                store_dir: Path | None) -> dict[str, Any]:
    """The extract stage's loop: shards extracted, then (with a store) written on the stage's writer thread."""
    n_layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    stack = find_decoder_stack(model, n_layers)
    stats = ShardStats()
    staging = HostStaging()
    writer = None
    if store_dir is not None:
        out = StageOutput(LocalStore(store_dir), "bench", "extract", f"bench-{storage}", {})
        out.begin()
        writer = ShardWriter(out)
    t0 = time.perf_counter()
    with HiddenCapture(stack, default_aux_layer_ids(n_layers)) as capture, writer or nullcontext():
        for p in shards:
            shard = extract_shard(capture, data, p, hidden, batch_tokens, storage, stats, staging)
            if writer is not None:
                writer.submit(p.index, shard)
            del shard
    wall = time.perf_counter() - t0  # with a writer: until its last shard is stored
    return {"wall_s": wall, "batches_s": stats.batches_s, "write_wait_s": writer.waited_s if writer else 0.0,
            "real_tokens": stats.real_tokens, "padded_tokens": stats.padded_tokens,
            "shard_bytes": writer.bytes_written if writer else 0}


def bench_target(name: str, config: Any, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(config, device, dtype)
    samples = random_samples(args.num_samples, args.min_len, args.max_len, config.vocab_size)
    data = from_lists(samples)
    shards = plan_shards(data.lengths(), args.shard_tokens)
    tokens = data.num_tokens
    # Warm-up (kernels, allocator) on the first shard's first batch, both paths.
    warm = plan_shards(data.lengths()[:2], 1 << 30)
    plain_forward(model, data, warm, args.batch_tokens, device)
    result: dict[str, Any] = {"target": name, "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                              "parameters": sum(p.numel() for p in model.parameters()), "dtype": str(dtype),
                              "samples": len(samples), "tokens": tokens, "shards": len(shards),
                              "batch_tokens": args.batch_tokens}
    plain_s = min(plain_forward(model, data, shards, args.batch_tokens, device) for _ in range(args.repeats))
    with tempfile.TemporaryDirectory() as tmp:
        runs = [extract_all(model, data, shards, args.batch_tokens, "bfloat16", None) for _ in range(args.repeats)]
        compute = min(runs, key=lambda r: r["wall_s"])
        if device.type == "cuda":
            result["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        written = {}
        for storage in ("bfloat16", "float8_e4m3fn"):
            written[storage] = extract_all(model, data, shards, args.batch_tokens, storage, Path(tmp) / f"store-{storage}")
    result.update({
        "plain_tokens_per_s": round(tokens / plain_s, 1),
        "extract_tokens_per_s": round(tokens / compute["wall_s"], 1),
        "extract_vs_plain": round(plain_s / compute["wall_s"], 4),
        "goal_extract_vs_plain": 0.9,
        "padding_ratio": round(1 - compute["real_tokens"] / compute["padded_tokens"], 4),
        "extract_with_write_tokens_per_s": {s: round(tokens / w["wall_s"], 1) for s, w in written.items()},
        # Time extraction stood waiting for the writer thread (disk + store slower than the GPU).
        "write_wait_share_of_wall": {s: round(w["write_wait_s"] / w["wall_s"], 4) for s, w in written.items()},
        "shard_bytes_per_token": {s: round(w["shard_bytes"] / tokens, 1) for s, w in written.items()},
    })
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="Where to write the JSON results.")
    ap.add_argument("--tiny", action="store_true", help="Tiny configs on CPU (a smoke run of the benchmark itself).")
    ap.add_argument("--targets", default="llama-8b,deepseek-small", help="Comma-separated: llama-8b, deepseek-small.")
    ap.add_argument("--num-samples", type=int, default=None)
    ap.add_argument("--min-len", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--batch-tokens", type=int, default=None)
    ap.add_argument("--shard-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2, help="Timed repetitions; the fastest counts.")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if not args.tiny and device.type == "cpu":
        print("no CUDA device: run with --tiny for a CPU smoke run", file=sys.stderr)
        return 2
    defaults = dict(num_samples=24, min_len=8, max_len=64, batch_tokens=256, shard_tokens=512) if args.tiny else \
        dict(num_samples=256, min_len=256, max_len=2048, batch_tokens=16384, shard_tokens=65536)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    builders = {"llama-8b": llama_8b_config, "deepseek-small": deepseek_small_config}
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "command": "python " + " ".join(["benchmarks/bench_extract.py", *(argv or sys.argv[1:])]),
               "targets": []}
    for name in args.targets.split(","):
        if name not in builders:
            print(f"unknown target {name!r}; choose from {', '.join(builders)}", file=sys.stderr)
            return 2
        r = bench_target(name, builders[name](args.tiny), args, device)
        print(json.dumps(r), flush=True)
        results["targets"].append(r)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")  # after each target: a cut-off run keeps what it measured
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
