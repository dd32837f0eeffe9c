"""What the DAG preflight costs the CLI: the checks of every stage, in a fresh interpreter.

The CLI runs every stage in its own process (a subprocess here, a pod on Kubernetes), so what
its own process imports is start-up paid before the first stage line. This measures, each in a
fresh interpreter on a built builtin target (best of ``--repeats``):

- preflight: ``check_run`` for every stage, as ``eagle3ctl run pipeline`` calls it: the target's
             config.json and tokenizer.json read without torch or transformers
- baseline:  the same three answers read the way a stage reads them (transformers' AutoConfig and
             AutoTokenizer, torch for the GPU count): what the preflight imported before

    python benchmarks/bench_preflight.py --out benchmarks/results/preflight.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETUP = """
from eagle3.config import load_config
cfg = load_config(None, {{"run_id": "bench", "store.uri": "file://{store}", "target.model": "builtin:tiny-llama",
                         "target.cache_dir": {cache!r}, "vocab.draft_vocab_size": 256}})
"""
PREFLIGHT = """
from eagle3.pipeline.preflight import check_run
from eagle3.stages import ORDER
check_run(cfg, set(ORDER))
"""
BASELINE = """
import torch
from eagle3.targets.load import load_target_config, load_tokenizer, num_layers, target_vocab_size
config = load_target_config(cfg.target)
answers = target_vocab_size(config), num_layers(config), len(load_tokenizer(cfg.target)), torch.cuda.is_available()
"""
REPORT = "import sys; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"


def timed(code: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return time.perf_counter() - t0, out.stdout.strip().splitlines()[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "targets")
        setup = SETUP.format(store=Path(tmp) / "store", cache=cache)
        timed(setup + "from eagle3.targets.tiny import builtin_target_dir; builtin_target_dir('llama', " + repr(cache) + ")\n"
              + REPORT)  # build the target once, outside the timings
        rows = {}
        for name, body in (("preflight", PREFLIGHT), ("baseline", BASELINE)):
            runs = [timed(setup + body + REPORT) for _ in range(a.repeats)]
            rows[name] = {"best_seconds": round(min(s for s, _ in runs), 3), "imported": runs[0][1]}
    result = {**rows, "ratio": round(rows["preflight"]["best_seconds"] / rows["baseline"]["best_seconds"], 3),
              "machine": f"{platform.machine()}, {platform.python_version()}", "repeats": a.repeats}
    print(json.dumps(result, indent=2))
    if a.out:
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
