import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train.py"


@pytest.mark.slow
def test_bench_train_tiny_runs_on_cpu_and_reports_ttt_overhead(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(BENCH), "--tiny", "--out", str(out), "--attention", "sdpa", "--steps", "1", "--warmup", "0",
           "--seq-len", "32", "--packed"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"ttt7_sdpa", "ttt7_sdpa_packed", "ttt1"}
    r = report["results"]["ttt7_sdpa"]
    assert r["tokens_per_s"] > 0 and r["ttt_overhead"] > 0 and report["config"]["draft_vocab_size"] == 256
    packed = report["results"]["ttt7_sdpa_packed"]
    assert packed["packed"] and packed["tokens_per_s"] > 0 and packed["loss"] > 0  # documents fit: rows are counted
