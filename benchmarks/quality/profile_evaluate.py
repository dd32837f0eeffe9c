"""Where the evaluate stage's time goes on the GPU: the stage run in this process under torch.profiler.

    python benchmarks/quality/profile_evaluate.py -c RUN.yaml --out DIR [--prompts 16] [--batch 16]

Runs ``eagle3 stage evaluate --force`` twice with ``evaluate.workers`` 1 (decoding in this
process) and the greedy check off: once plainly (wall seconds), once under the profiler.
Writes ``DIR/evaluate_profile.json`` (timings) and ``DIR/evaluate_profile.txt`` (the top ops by
CPU and by CUDA time). The drafter need not be good: rejected drafts make the most rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import yaml


def run_stage(cfg: Path) -> float:
    from eagle3.cli.stage import main

    argv, sys.argv = sys.argv, ["eagle3", "stage", "evaluate", "-c", str(cfg), "--force"]
    t0 = time.perf_counter()
    try:
        main()
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        sys.argv = argv
    return round(time.perf_counter() - t0, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=None, help="evaluate.max_new_tokens (default the config's)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load(a.config.read_text())
    cfg["evaluate"].update(workers=1, batch_size=a.batch, num_prompts=a.prompts, check_greedy=0)
    if a.new_tokens:
        cfg["evaluate"]["max_new_tokens"] = a.new_tokens
    path = a.out / "evaluate.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    timings = {"plain": run_stage(path)}
    print(f"profile_evaluate: plain run {timings['plain']} s", flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=acts) as prof:
        timings["profiled"] = run_stage(path)
    ka = prof.key_averages()
    text = ["# by CPU time (self)", ka.table(sort_by="self_cpu_time_total", row_limit=40)]
    if torch.cuda.is_available():
        text += ["# by CUDA time", ka.table(sort_by="cuda_time_total", row_limit=40)]
    (a.out / "evaluate_profile.txt").write_text("\n".join(text))
    (a.out / "evaluate_profile.json").write_text(json.dumps(timings, indent=2) + "\n")
    print(json.dumps(timings), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
