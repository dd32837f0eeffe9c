"""The tiny pipeline against S3 through a proxy that fails one request in ten, to completion.

The store is the moto S3 server behind ``tests.fault_proxy.FaultProxy`` on 127.0.0.1: 10 %
of requests (seeded) are answered 500 or 503 by the proxy, or forwarded and their response
cut mid-body. Every process of the run (eagle3ctl, each stage, the server) goes through it.
The run must finish in one go, and ``verify --deep`` (through the same faults) pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fault_proxy import FaultProxy
from tests.reliability.tiny_run import write_config
from tests.fixtures_s3 import MotoS3
from tests.waiting import HANG_GUARD_S

pytestmark = [pytest.mark.slow, pytest.mark.s3, pytest.mark.timeout(HANG_GUARD_S)]



def test_pipeline_on_a_faulty_s3_runs_to_completion(tmp_path: Path, tiny_cache_dir: Path, moto_s3: MotoS3,
                                                    s3_store_uri: str) -> None:
    config = write_config(tmp_path, "flaky", s3_store_uri, tiny_cache_dir, steps=12, prompts=4)
    seed = int(os.environ.get("EAGLE3_TEST_SEED", "18"))
    with FaultProxy(moto_s3.endpoint, rate=0.10, seed=seed) as proxy:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_")}
        env["AWS_ENDPOINT_URL"] = proxy.url

        def cli(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "eagle3.cli.app", *args, "-c", str(config)], cwd=tmp_path,
                                  env=env, capture_output=True, text=True)

        r = cli("run", "pipeline")
        assert r.returncode == 0, f"seed {seed}, {dict(proxy.counts)}: " + r.stdout[-3000:] + r.stderr[-3000:]
        v = cli("verify", "--deep")
        assert v.returncode == 0, f"seed {seed}: " + v.stdout + v.stderr
        counts = dict(proxy.counts)
    assert counts["faults"] >= 20, counts  # the run met faults and rode them out
    assert "Traceback" not in r.stdout + r.stderr
    out = os.environ.get("EAGLE3_RELIABILITY_REPORT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "s3_faults.json").write_text(json.dumps({"seed": seed, "rate": 0.10, **counts}, indent=2) + "\n")
