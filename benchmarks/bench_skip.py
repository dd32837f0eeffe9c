"""What a skip costs: verifying a committed stage on every rerun, against reading it back.

A stage is skipped only when its manifest, input key and every object's size and content
digest check out (``eagle3.manifest.verify_stage``): objects up to SMALL_OBJECT are
re-hashed, larger ones compared by the store's fingerprint. This measures, in one process:

- write:    committing a synthetic extract stage of ``--gb`` GB of shards (random bytes,
            ``--shard-mb`` MB each, the default 256 MB is extract's order of size) through
            StageOutput into a file:// store
- skip:     ``verify_stage`` with the input key, as every rerun does (best of 3)
- readback: the baseline, re-hashing every byte (``deep`` without content checks) — what a
            skip would cost if digests were re-read; measured once, cold for most of the data
            once it exceeds the page cache
- the tiny pipeline's no-op rerun: ``eagle3ctl run pipeline -c examples/tiny.yaml`` a second
            time (every stage skipped), end to end, with ``--tiny-run``

Goal: skip ≤ 5 s and ≤ 2 % of readback.

    python benchmarks/bench_skip.py --gb 20 --out benchmarks/results/skip.json [--tiny-run]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3.manifest import StageOutput, compute_input_key, verify_stage
from eagle3.store.local import LocalStore

KEY = compute_input_key("extract", {"bench": "skip"}, {"generate": "synthetic"})


def write_stage(store: LocalStore, gb: float, shard_mb: int) -> tuple[int, int, float]:
    out = StageOutput(store, "bench", "extract", KEY, {})
    out.begin(fresh=True)
    block = os.urandom(8 << 20)  # 8 MiB of random bytes, rotated so no two shards are equal
    n = max(1, int(gb * 1024 / shard_mb))
    t0 = time.perf_counter()
    for i in range(n):
        with out.writer(f"shards/shard-{i:06d}.safetensors") as w:
            for j in range(shard_mb // 8):
                w.write(block[j % 64:] + block[: j % 64] if j else bytes([i % 256]) + block[1:])
    out.put_json("index.json", {"shards": n})
    out.commit({"shards": n})
    return n, n * shard_mb << 20, time.perf_counter() - t0


def timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def tiny_noop_rerun(repo: Path) -> dict:
    """Run the tiny pipeline once (not timed), then again: the no-op rerun's wall time."""
    work = Path(tempfile.mkdtemp(prefix="bench-skip-tiny-"))
    cmd = [str(Path(sys.executable).parent / "eagle3ctl"), "run", "pipeline", "-c", str(repo / "examples/tiny.yaml")]
    try:
        subprocess.run(cmd, cwd=work, check=True, capture_output=True, timeout=1800)
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            r = subprocess.run(cmd, cwd=work, check=True, capture_output=True, text=True, timeout=600)
            walls.append(time.perf_counter() - t0)
            assert r.stdout.count("skipped (complete") == 6, r.stdout
        return {"noop_rerun_s_best": round(min(walls), 3), "noop_rerun_s_all": [round(w, 3) for w in walls]}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=20.0)
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--dir", type=Path, default=None, help="where the synthetic store goes (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tiny-run", action="store_true", help="also time the tiny pipeline's no-op rerun")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-skip-", dir=args.dir))
    try:
        store = LocalStore(root)
        n, nbytes, write_s = write_stage(store, args.gb, args.shard_mb)
        skips = []
        for _ in range(3):
            v = None

            def skip() -> None:
                nonlocal v
                v = verify_stage(store, "bench", "extract", input_key=KEY)

            skips.append(timed(skip))
            assert v is not None and v.complete and v.rehashed == 1  # index.json only
        readback = timed(lambda: verify_stage(store, "bench", "extract", input_key=KEY, deep=True))
        result = {
            "shards": n, "bytes": nbytes, "gb": round(nbytes / 1e9, 2), "write_s": round(write_s, 2),
            "skip_s_best": round(min(skips), 4), "skip_s_all": [round(s, 4) for s in skips],
            "readback_s": round(readback, 2), "readback_gb_per_s": round(nbytes / 1e9 / readback, 2),
            "skip_over_readback": round(min(skips) / readback, 5),
            "goal": "skip <= 5 s and <= 0.02 x readback",
        }
        result["goal_met"] = result["skip_s_best"] <= 5 and result["skip_over_readback"] <= 0.02
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.tiny_run:
        result["tiny"] = tiny_noop_rerun(Path(__file__).resolve().parents[1])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
