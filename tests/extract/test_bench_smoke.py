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
