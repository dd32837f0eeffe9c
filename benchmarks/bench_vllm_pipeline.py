"""The whole pipeline in real vLLM on one GPU, checked against the transformers engines.

For one tiny target (``tiny`` = examples/tiny.yaml, Llama; ``tiny-kimi`` =
examples/tiny-kimi.yaml, Kimi-K2.5's structure), in the dtype it is served in:

1. ``vllm``: serve.engine vllm with a reasoning parser -> generate -> vocab ->
   extract.engine vllm -> train on the GPU -> export -> evaluate.engine vllm.
2. ``hf-extract``: the same config with extract.engine hf, adopting step 1's generate
   (``--reuse-from``, ``--until extract``): the hidden-state agreement of the two engines.
3. ``hf-evaluate``: the same config with evaluate.engine hf, adopting steps 1's
   generate..export: acceptance of the same drafter on the same prompts by the product's
   own evaluator.
4. vLLM driven directly on the evaluate prompts: greedy outputs with and without the
   drafter (must be equal), and each prompt's acceptance per position (metrics read
   between prompts) beside the hf evaluator's per-prompt rows.

Writes ``<out>/<target>.json`` (every figure) and ``<out>/<target>.png`` (acceptance per
position, vLLM vs hf). Needs vLLM (a supported version) and a CUDA GPU:

    python benchmarks/bench_vllm_pipeline.py --target tiny --dtype float32 --work /tmp/e3v --out results/
    python benchmarks/bench_vllm_pipeline.py --target tiny-kimi --dtype bfloat16 --work /tmp/e3v --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {  # example config, reasoning parser vLLM starts with
    "tiny": ("examples/tiny.yaml", "qwen3"),
    "tiny-kimi": ("examples/tiny-kimi.yaml", "kimi_k2"),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_config(args: argparse.Namespace, variant: str) -> Path:
    """The example's config for the GPU, every stage in vLLM except where ``variant`` says hf."""
    example, parser = TARGETS[args.target]
    cfg = yaml.safe_load((ROOT / example).read_text())
    run_id = f"gpu-{args.target}" if variant == "vllm" else f"gpu-{args.target}-{variant}"
    cfg.update(run_id=run_id, store={"uri": f"file://{args.work}/store"})
    cfg["target"]["dtype"] = args.dtype
    vllm, device = ("hf", "cpu") if args.cpu_check else ("vllm", "cuda")  # --cpu-check: the plumbing, no vLLM
    if not args.cpu_check:
        cfg["serve"] = {"engine": "vllm", "reasoning_parser": parser, "startup_timeout_s": 900,
                        "extra_args": ["--enforce-eager", "--gpu-memory-utilization", "0.3"]}
    cfg["extract"].update(device=device, engine="hf" if variant == "hf-extract" else vllm,
                          storage_dtype="float32" if args.dtype == "float32" else "bfloat16",
                          vllm={"gpu_memory_utilization": 0.3})
    cfg["train"].update(device=device, compile=False)  # the drafter's speed is not measured here
    cfg["evaluate"].update(device=device, engine="hf" if variant == "hf-evaluate" else vllm,
                           vllm={"gpu_memory_utilization": 0.3, "enforce_eager": True})  # as the direct run's engine
    path = args.work / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def eagle3ctl(args: argparse.Namespace, *extra: str) -> float:
    """Run the CLI (its output into the log, progress lines through); seconds taken."""
    cmd = [sys.executable, "-m", "eagle3.cli.app", *extra]
    log("$ eagle3ctl " + " ".join(extra))
    t0 = time.perf_counter()
    with open(args.work / "eagle3ctl.log", "a") as f:
        rc = subprocess.run(cmd, cwd=args.work, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = (args.work / "eagle3ctl.log").read_text().splitlines()[-40:]
        raise SystemExit(f"eagle3ctl {' '.join(extra)} exited {rc}:\n" + "\n".join(tail))
    return round(time.perf_counter() - t0, 1)


def manifest(args: argparse.Namespace, run_id: str, stage: str) -> dict[str, Any]:
    return json.loads((args.work / "store" / run_id / stage / "manifest.json").read_text())


def stage_file(args: argparse.Namespace, run_id: str, stage: str, name: str) -> Path:
    m = manifest(args, run_id, stage)
    return args.work / "store" / run_id / stage / m.get("root", "") / name


def journaled_prompts(args: argparse.Namespace, run_id: str, n: int) -> list[dict[str, Any]]:
    """The hf evaluator's per-prompt results as the stage journaled them: every verify step's length."""
    return [json.loads(stage_file(args, run_id, "evaluate", f"prompts/prompt-{i:06d}.json").read_text())
            for i in range(n)]


def hidden_agreement(args: argparse.Namespace, a: str, b: str) -> dict[str, Any]:
    """Per aux layer and the final state: cosine (min over tokens), relative L2, max abs, engine a vs b."""
    import torch
    from safetensors.torch import load_file

    shards = sorted(k["key"] for k in manifest(args, a, "extract")["objects"] if k["key"].startswith("shards/"))
    sums: dict[str, dict[str, float]] = {}
    for key in shards:
        sa, sb = load_file(str(stage_file(args, a, "extract", key))), load_file(str(stage_file(args, b, "extract", key)))
        if not torch.equal(sa["input_ids"], sb["input_ids"]):
            raise SystemExit(f"{key}: the two runs' shards hold different tokens")
        h = sa["final_hidden"].shape[-1]
        for name, xa, xb in [(f"aux{i}", sa["aux_hidden"][:, i * h:(i + 1) * h], sb["aux_hidden"][:, i * h:(i + 1) * h])
                             for i in range(3)] + [("final", sa["final_hidden"], sb["final_hidden"])]:
            xa, xb = xa.float(), xb.float()
            cos = torch.nn.functional.cosine_similarity(xa, xb, dim=-1)
            s = sums.setdefault(name, {"cos_min": 1.0, "diff2": 0.0, "ref2": 0.0, "max_abs": 0.0, "tokens": 0})
            s["cos_min"] = min(s["cos_min"], float(cos.min()))
            s["diff2"] += float(((xa - xb) ** 2).sum())
            s["ref2"] += float((xb**2).sum())
            s["max_abs"] = max(s["max_abs"], float((xa - xb).abs().max()))
            s["tokens"] += xa.shape[0]
    return {n: {"cosine_min": round(s["cos_min"], 6), "relative_l2": round((s["diff2"] / s["ref2"]) ** 0.5, 6),
                "max_abs": round(s["max_abs"], 5), "tokens": s["tokens"]} for n, s in sums.items()}


def vllm_direct(args: argparse.Namespace, run_id: str) -> dict[str, Any]:
    """Greedy with and without the drafter, and per-prompt acceptance, in a process of its own."""
    out = args.work / f"{run_id}-direct.json"
    cmd = [sys.executable, __file__, "--direct", run_id, "--target", args.target, "--dtype", args.dtype,
           "--work", str(args.work), "--out", str(args.out)]
    with open(args.work / "direct.log", "a") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = (args.work / "direct.log").read_text().splitlines()[-40:]
        raise SystemExit("vLLM direct run failed:\n" + "\n".join(tail))
    return json.loads(out.read_text())


def direct(args: argparse.Namespace, run_id: str) -> None:
    """(In its own process.) The evaluate stage's prompts through vLLM, plain and speculative."""
    from vllm import LLM, SamplingParams

    from eagle3.config import load_config
    from eagle3.evaluate.stage import held_out_prompt_ids
    from eagle3.evaluate.vllm_engine import spec_decode_counts
    from eagle3.targets.load import resolve_target

    cfg = load_config(args.work / f"{run_id}.yaml")
    _, prompts = held_out_prompt_ids(cfg)
    model, k = resolve_target(cfg.target), cfg.evaluate.num_draft_tokens
    params = SamplingParams(temperature=0.0, max_tokens=cfg.evaluate.max_new_tokens)
    common = {"model": model, "dtype": args.dtype, "enforce_eager": True, "gpu_memory_utilization": 0.3,
              "trust_remote_code": cfg.target.trust_remote_code}
    plain = LLM(**common)
    plain_out = [list(o.outputs[0].token_ids) for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    del plain
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    export_dir = stage_file(args, run_id, "export", "config.json").parent
    spec = LLM(**common, disable_log_stats=False,
               speculative_config={"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": k})
    rows, spec_out, before = [], [], spec_decode_counts(spec.get_metrics(), k)
    for p in prompts:  # one prompt at a time: the counters' deltas are that prompt's
        o = spec.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        after = spec_decode_counts(spec.get_metrics(), k)
        rows.append({"drafts": after["drafts"] - before["drafts"], "accepted": after["accepted"] - before["accepted"],
                     "accepted_per_position": [a - b for a, b in zip(after["accepted_per_position"],
                                                                    before["accepted_per_position"])]})
        spec_out.append(list(o.outputs[0].token_ids))
        before = after
    result = {"greedy_equal": [a == b for a, b in zip(plain_out, spec_out)], "per_prompt": rows,
              "tokens": spec_out, "plain_tokens": plain_out}
    (args.work / f"{run_id}-direct.json").write_text(json.dumps(result))


def plot(path: Path, title: str, vllm_pos: list[int], hf_pos: list[int], drafts: tuple[int, int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(vllm_pos)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(k)
    ax.bar([x - 0.2 for x in xs], [v / max(drafts[0], 1) for v in vllm_pos], 0.4, label="vLLM")
    ax.bar([x + 0.2 for x in xs], [v / max(drafts[1], 1) for v in hf_pos], 0.4, label="hf evaluator")
    ax.set_xticks(list(xs), [str(x + 1) for x in xs])
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts (cumulative)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(TARGETS), required=True)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu-check", action="store_true",
                    help="the same runs with the hf engines on the CPU (no vLLM): checks the benchmark's plumbing")
    ap.add_argument("--direct", metavar="RUN_ID", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.work, args.out = args.work.resolve() / args.target, args.out.resolve()
    if args.direct:
        return direct(args, args.direct)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    a, hx, he = (write_config(args, v) for v in ("vllm", "hf-extract", "hf-evaluate"))
    run_a = f"gpu-{args.target}"
    seconds = {"pipeline_vllm": eagle3ctl(args, "run", "pipeline", "-c", str(a)),
               "extract_hf": eagle3ctl(args, "run", "pipeline", "-c", str(hx), "--reuse-from", run_a,
                                       "--until", "extract"),
               "evaluate_hf": eagle3ctl(args, "run", "pipeline", "-c", str(he), "--reuse-from", run_a)}
    log("comparing hidden states")
    hidden = hidden_agreement(args, run_a, f"{run_a}-hf-extract")
    rep_v = json.loads(stage_file(args, run_a, "evaluate", "report.json").read_text())
    rep_h = json.loads(stage_file(args, f"{run_a}-hf-evaluate", "evaluate", "report.json").read_text())
    hf_rows = journaled_prompts(args, f"{run_a}-hf-evaluate", rep_h["num_prompts"])
    if args.cpu_check:  # the first run's evaluate is hf too: its journal stands where vLLM's counters would
        d = {"greedy_equal": [], "per_prompt": [
            {"drafts": len(r["accept_lengths"]), "accepted": sum(r["accept_lengths"]) - len(r["accept_lengths"]),
             "accepted_per_position": r["accepted_at"]} for r in journaled_prompts(args, run_a, rep_v["num_prompts"])]}
        version = "none (--cpu-check)"
    else:
        log("vLLM directly: greedy with and without the drafter, acceptance per prompt")
        d = vllm_direct(args, run_a)
        import vllm

        version = vllm.__version__
    differing = [{"prompt": i, "vllm": r, "hf": {"drafts": len(h["accept_lengths"]), "accepted_at": h["accepted_at"],
                                                 "accept_lengths": h["accept_lengths"]}}
                 for i, (r, h) in enumerate(zip(d["per_prompt"], hf_rows))
                 if r["drafts"] != len(h["accept_lengths"]) or r["accepted_per_position"] != h["accepted_at"]]
    gen = manifest(args, run_a, "generate")["stats"]
    mal_v, mal_h = rep_v["mean_acceptance_length"], rep_h["mean_acceptance_length"]
    result = {
        "target": args.target, "dtype": args.dtype, "vllm_version": version, "gpu": gpu_name(),
        "seconds": seconds,
        "reasoning": {k: v for k, v in gen.items() if "reason" in k},
        "hidden_state_agreement_vllm_vs_hf": hidden,
        "acceptance": {"vllm": mal_v, "hf": mal_h, "vllm_over_hf": round(mal_v / mal_h, 4),
                       "k": rep_v["num_draft_tokens"], "prompts": rep_v["num_prompts"],
                       "vllm_accepted_per_position": rep_v["accepted_per_position"], "vllm_drafts": rep_v["verify_steps"],
                       "hf_accepted_per_position": rep_h["accepted_per_position"], "hf_drafts": rep_h["verify_steps"]},
        "greedy_equal_with_and_without_drafter": f"{sum(d['greedy_equal'])}/{len(d['greedy_equal'])}",
        "prompts_whose_drafts_differ": f"{len(differing)}/{len(hf_rows)}",
        "differing_prompts": differing,
    }
    (args.out / f"{args.target}.json").write_text(json.dumps(result, indent=1))
    plot(args.out / f"{args.target}.png", f"{args.target} ({args.dtype}), vLLM {version}: mean acceptance "
         f"vLLM {mal_v:.3f}, hf {mal_h:.3f}", rep_v["accepted_per_position"], rep_h["accepted_per_position"],
         (rep_v["verify_steps"], rep_h["verify_steps"]))
    log(json.dumps({k: result[k] for k in ("acceptance", "greedy_equal_with_and_without_drafter", "reasoning")}))


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    main()
