import json

import pytest


@pytest.mark.slow
def test_bench_extract_tiny_runs_and_reports(tmp_path):
    from benchmarks.bench_extract import main

    out = tmp_path / "bench.json"
    assert main(["--tiny", "--targets", "llama-8b", "--num-samples", "8", "--repeats", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["targets"][0]
    assert r["tokens"] > 0 and r["plain_tokens_per_s"] > 0 and r["extract_tokens_per_s"] > 0
    assert r["shard_bytes_per_token"]["float8_e4m3fn"] < r["shard_bytes_per_token"]["bfloat16"]


def test_bench_kimi_slice_tiny_runs_and_reports(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "benchmarks/bench_kimi_slice.py", "--tiny", "--layers", "3", "--tokens", "256",
                        "--seq-len", "64", "--batch-tokens", "128", "--out", str(tmp_path)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "kimi_slice.json").read_text())
    assert report["tokens"] == 256 and report["tokens_per_s"] > 0 and 0 < report["roofline_share"] < 1
    assert report["moe_layers"] == 2 and report["active_parameters_per_token"]["total"] < report["parameters"]


def test_kimi_active_parameters_at_real_widths():
    from benchmarks.bench_kimi_slice import KIMI, active_params_per_token

    full = active_params_per_token(KIMI, 61)["total"]  # + embed/lm_head: Kimi-K2.5's ~32B active
    assert 28e9 < full + 2 * 163840 * 7168 < 36e9
