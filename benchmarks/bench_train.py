"""Drafter training throughput: tokens/s and peak memory of TTT training, self-contained.

Random weights and data (no store, no target): the drafter of a Llama-3.1-8B-sized
target (hidden 4096, intermediate 14336, 32 heads, 8 kv heads, vocab 128256, draft
vocab 32000), bf16 autocast, fp32 master weights, fused AdamW, sequence length 2048.

Modes, each measured in the same run:
  ttt{N}_{attention}  the full objective with N TTT steps (default 7), flex and/or sdpa attention,
                      compiled as the train stage runs it on CUDA (train.compile)
  ttt{N}_{attention}_eager  the same without torch.compile (GPU runs)
  ttt{N}_{attention}_packed  with --packed: the same batch shape, each row packed with documents
                      of 100-900 tokens (train.pack, the stage's default): document-masked attention,
                      its block masks built per step as the stage builds them per batch
  ttt1                a plain forward+backward of the same drafter (one step): the baseline
The JSON reports ``ttt_overhead`` = tokens/s of ttt1 / tokens/s of the TTT mode.

    python benchmarks/bench_train.py --out results/train.json             # one GPU
    python benchmarks/bench_train.py --gpus 8 --out results/train8.json  # DDP scaling via torchrun
    python benchmarks/bench_train.py --tiny --out /tmp/t.json             # CPU smoke test
    python benchmarks/bench_train.py --shape quality --batch 8 --counted 0.4 --out results/train_quality.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.drafter.loss import TTTObjective, row_counts  # noqa: E402
from eagle3.drafter.masks import pack_block_lists  # noqa: E402
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter  # noqa: E402

LLAMA_8B = dict(hidden_size=4096, target_hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, draft_vocab_size=32000,
                rope_theta=500000.0, max_position_embeddings=8192, aux_layer_ids=[2, 16, 29])
# The drafter of benchmarks/quality's ~133M target (the race against speculators).
QUALITY = dict(hidden_size=640, target_hidden_size=640, intermediate_size=1728, num_attention_heads=10,
               num_key_value_heads=2, head_dim=64, vocab_size=64000, draft_vocab_size=16384,
               rms_norm_eps=1e-5, aux_layer_ids=[2, 6, 9])
SHAPES = {"llama8b": LLAMA_8B, "quality": QUALITY}
TINY = dict(hidden_size=64, target_hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=1000, draft_vocab_size=256, aux_layer_ids=[1, 2, 3])


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results path")
    p.add_argument("--tiny", action="store_true", help="tiny drafter on CPU (smoke test)")
    p.add_argument("--shape", default="llama8b", choices=sorted(SHAPES), help="drafter shape (GPU runs)")
    p.add_argument("--counted", type=float, default=1.0, help="share of rows that carry loss (assistant tokens)")
    p.add_argument("--profile", action="store_true", help="also print the top CUDA kernels of the first mode")
    p.add_argument("--packed", action="store_true", help="also measure packed rows (document-masked, train.pack)")
    p.add_argument("--seq-len", type=int, default=None, help="default 2048 (tiny: 128)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step per GPU")
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--steps", type=int, default=None, help="timed steps per mode (default 10; tiny 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per mode (default 3; tiny 1)")
    p.add_argument("--attention", default="flex,sdpa", help="comma list for the TTT mode: flex, sdpa")
    p.add_argument("--chunk-rows", type=int, default=None, help="loss chunk (rows of logits alive at once; "
                   "default: the train stage's, 2**27 logits)")
    p.add_argument("--gpus", type=int, default=1, help="processes: >1 relaunches itself under torchrun (DDP)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.seq_len = a.seq_len or (128 if a.tiny else 2048)
    a.steps = a.steps or (3 if a.tiny else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 3)
    return a


def relaunch_under_torchrun(a: argparse.Namespace) -> int:
    args = [x for x in sys.argv[1:]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.gpus}", __file__, *args, "--worker"]
    return subprocess.call(cmd)


def packed_doc_ids(rows: int, tokens: int, g: torch.Generator) -> torch.Tensor:
    """[rows, tokens]: each row documents of 100-900 tokens (fewer in short rows) end to end, its tail padding (-1)."""
    docs = torch.full((rows, tokens), -1, dtype=torch.int32)
    lo, hi = min(100, tokens // 8), min(900, tokens // 2)
    for r in range(rows):
        at = d = 0
        while True:
            n = int(torch.randint(lo, hi + 1, (1,), generator=g))
            if at + n > tokens:
                break
            docs[r, at : at + n] = d
            at, d = at + n, d + 1
    return docs


def measure(cfg: DrafterConfig, a: argparse.Namespace, ttt: int, attention: str, device: torch.device, world: int, rank: int,
            compiled: bool = False, packed: bool = False) -> dict:
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.embed_tokens.weight.requires_grad_(False)
    cuda = device.type == "cuda"
    objective = TTTObjective(drafter, ttt, 0.8, chunk_rows=a.chunk_rows, attention=attention, compiled=compiled).to(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    drafter.embed_tokens.weight.data = drafter.embed_tokens.weight.data.to(dtype)
    objective.teacher_head = (torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size, device=device) * 0.02).to(dtype)
    model = objective
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(objective, device_ids=[device.index] if cuda else None)
    params = [p for p in objective.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda or None)
    b, t, h = a.batch, a.seq_len, cfg.target_hidden_size
    g = torch.Generator(device="cpu").manual_seed(rank)
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g).to(device)
    aux = torch.randn(b, t, 3 * h, generator=g).to(device, dtype)
    final = torch.randn(b, t, h, generator=g).to(device, dtype)
    mask = (torch.rand(b, t, generator=g) < a.counted).to(device, torch.uint8)
    docs = packed_doc_ids(b, t, g).to(device) if packed else None
    # As the train stage: the rows each step counts are known from the host copy (no sync per step).
    counts = row_counts(mask.cpu(), None if docs is None else docs.cpu(), ttt)
    # and, for packed rows on flex, every step's block lists are made on the host with the batch
    packed_lists = pack_block_lists(docs.cpu(), ttt, pin=cuda) if docs is not None and attention == "flex" else None
    lists = None if packed_lists is None else (packed_lists[0].to(device), packed_lists[1])

    def step() -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss, *_ = model(ids, aux, final, mask, docs, counts=counts, block_lists=lists)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    for _ in range(a.warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    loss = 0.0
    for _ in range(a.steps):
        loss = step()
    if cuda:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    tokens = b * t * a.steps * world
    prof_stats = None
    if a.profile and rank == 0:
        from torch.profiler import ProfilerActivity, profile

        from eagle3.train.profiling import device_busy

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        t1 = time.perf_counter()
        with profile(activities=acts) as prof:
            for _ in range(2):
                step()
            if cuda:
                torch.cuda.synchronize(device)
        wall = (time.perf_counter() - t1) / 2
        busy_us, events = device_busy(prof.events())
        # Device busy well below the wall: the step waits on the host (launches, Python), not on the GPU.
        prof_stats = {"wall_ms_per_step": round(1000 * wall, 2), "device_busy_ms_per_step": round(busy_us / 2000, 2),
                      "device_events_per_step": events // 2}
        if not getattr(a, "_profiled", False) or packed:  # the table of the first mode and of packed rows
            a._profiled = True
            key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60), flush=True)
    out = {
        "ttt_steps": ttt, "attention": attention, "compiled": compiled, "packed": packed,
        "tokens_per_s": round(tokens / elapsed, 1),
        "tokens_per_s_per_gpu": round(tokens / elapsed / world, 1), "step_ms": round(1000 * elapsed / a.steps, 2), "loss": loss,
    }
    if cuda:
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    if prof_stats is not None:
        out["profile"] = prof_stats
    del model, objective, drafter, opt
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> int:
    a = parse()
    if a.gpus > 1 and not a.worker:
        return relaunch_under_torchrun(a)
    world, rank, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() and not a.tiny
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if cuda else "gloo")
    cfg = DrafterConfig(**(TINY if a.tiny else SHAPES[a.shape]))
    # The train stage's default on CUDA is compiled (train.compile); eager is measured beside it.
    compile_modes = [True, False] if cuda else [False]
    modes = [(a.ttt, att.strip(), c, False) for c in compile_modes for att in a.attention.split(",") if att.strip()]
    if a.packed:
        modes.insert(1, (a.ttt, "flex" if cuda else "sdpa", cuda, True))
    modes.append((1, "sdpa", cuda, False))
    results = {}
    for ttt, att, compiled, packed in modes:
        name = (f"ttt{ttt}_{att}" if ttt > 1 else "ttt1") + ("" if compiled or not cuda else "_eager") + ("_packed" if packed else "")
        try:
            results[name] = measure(cfg, a, ttt, att, device, world, rank, compiled, packed)
        except Exception as e:  # noqa: BLE001 (one mode failing, e.g. flex compile, must not lose the others)
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]}
        if rank == 0:
            print(name, json.dumps(results[name]), flush=True)
    base = results.get("ttt1", {}).get("tokens_per_s")
    for name, r in results.items():
        if base and name != "ttt1" and "tokens_per_s" in r:
            r["ttt_overhead"] = round(base / r["tokens_per_s"], 3)
    if rank == 0:
        report = {
            "benchmark": "train",
            "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
            "world_size": world,
            "torch": torch.__version__,
            "shape": "tiny" if a.tiny else a.shape,
            "config": cfg.to_dict(),
            "counted_rows": a.counted,
            "command": "python " + " ".join(["benchmarks/bench_train.py", *sys.argv[1:]]),
            "seq_len": a.seq_len, "batch": a.batch, "timed_steps": a.steps, "warmup_steps": a.warmup,
            "bf16_autocast": cuda,
            "results": results,
        }
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["results"], indent=2))
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
