"""The quality benchmark's stand-in generation server (benchmarks/quality/serve_batched.py)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

from tests.fixtures_targets import free_port

SERVER = Path(__file__).resolve().parents[2] / "benchmarks" / "quality" / "serve_batched.py"


def test_a_burst_of_connections_is_gathered_into_one_batch(tiny_llama_dir, tmp_path):
    """256 requests opened at once all reach the batcher together. With socketserver's listen
    backlog of 5 the kernel dropped the SYNs it had no room for, and those requests trickled
    in over TCP's retransmit backoff as many small batches, each costing a full generate call
    (run 4 on the H200: 245 s for 90 s of generating)."""
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(SERVER), str(tiny_llama_dir), "--port", str(port),
                                 "--max-batch", "1024", "--device", "cpu"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.5)

        async def burst() -> list[dict]:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                async def one(i: int) -> dict:
                    body = {"messages": [{"role": "user", "content": f"count to {i}"}], "max_tokens": 2}
                    async with s.post(url, json=body) as r:
                        assert r.status == 200
                        return await r.json()

                return await asyncio.gather(*(one(i) for i in range(256)))

        answers = asyncio.run(burst())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert len(answers) == 256
    assert all(a["choices"][0]["finish_reason"] in ("stop", "length") for a in answers)
    batches = re.findall(r"batch \d+ of (\d+) requests", log.read_text())
    assert [int(b) for b in batches] == [256], f"256 simultaneous requests came in batches of {batches}"
