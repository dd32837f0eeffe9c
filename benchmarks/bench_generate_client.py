"""Benchmark: the generate client's own overhead, against an endpoint that answers instantly.

The endpoint is :class:`InstantChatEndpoint`, a test double: a minimal asyncio HTTP/1.1
server (keep-alive, no framework) in a subprocess that answers every
``POST /v1/chat/completions`` at once with a fixed completion. What is measured is
therefore the client: request building, JSON, connection pool, retry wrapper, workers.
Goal: >= 500 requests/s on 2 cores (server and client each get one). Reported both as the
wall rate and as requests per second of client CPU (what the client alone sustains on one
core; the wall rate on a shared, loaded host also counts other people's work), with the
test double's own CPU per request alongside to show it is not the bottleneck.

    python benchmarks/bench_generate_client.py [--requests 4000] [--concurrency 64]

Writes ``benchmarks/results/generate_client.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

GOAL_RPS = 500.0
RESULTS = Path(__file__).parent / "results" / "generate_client.json"

_COMPLETION = json.dumps({
    "id": "bench", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "An instant answer of a few words."}}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20},
}).encode()
_MODELS = json.dumps({"object": "list", "data": [{"id": "bench", "object": "model"}]}).encode()


def _http_200(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


_COMPLETION_RESPONSE, _MODELS_RESPONSE = _http_200(_COMPLETION), _http_200(_MODELS)


class InstantChatEndpoint(asyncio.Protocol):
    """Test double: answers /v1/models and /v1/chat/completions instantly (HTTP/1.1 keep-alive).

    A raw asyncio protocol, no framework and no stream objects, so that it costs a small
    fraction of what the client under test does: it parses just enough of each request
    (head up to the blank line, ``content-length`` body) and writes a canned response.
    It runs in its own process, so its CPU is not counted as the client's.
    """

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        out = []
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end]
            length = _content_length(head)
            if len(buf) < end + 4 + length:
                break  # body not all here yet
            buf = buf[end + 4 + length:]
            out.append(_MODELS_RESPONSE if head.startswith(b"GET") else _COMPLETION_RESPONSE)
        self.buf = buf
        if out:
            self.transport.write(b"".join(out))

    @classmethod
    def serve(cls, port: int) -> None:
        async def main() -> None:
            server = await asyncio.get_running_loop().create_server(cls, "127.0.0.1", port, backlog=1024)
            async with server:
                await server.serve_forever()

        asyncio.run(main())


def _content_length(head: bytes) -> int:
    i = head.lower().find(b"content-length:")
    if i < 0:
        return 0
    eol = head.find(b"\r\n", i)
    return int(head[i + 15:eol if eol >= 0 else len(head)])


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"test double endpoint did not listen on {port}")


async def _measure(base_url: str, n: int, concurrency: int, server_pid: int) -> dict:
    from eagle3.generate.client import ChatClient, ChatParams

    params = ChatParams(model="bench", max_tokens=16)
    jobs = [(i, [{"role": "user", "content": f"prompt number {i}: say something short"}]) for i in range(n)]
    async with ChatClient(base_url, concurrency=concurrency, timeout_s=30) as client:
        assert await client.list_models() == ["bench"]
        warm = [(i, m) for i, m in jobs[: min(200, n)]]
        async for _ in client.run(warm, params):
            pass
        t0, cpu0, server0 = time.perf_counter(), time.process_time(), _process_cpu_s(server_pid)
        ok = failed = 0
        async for outcome in client.run(jobs, params):
            ok += outcome.error is None
            failed += outcome.error is not None
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        server_cpu = _process_cpu_s(server_pid) - server0
    return {"requests": n, "succeeded": ok, "failed": failed, "wall_s": round(wall, 3),
            "client_cpu_s": round(cpu, 3), "requests_per_s": round(n / wall, 1),
            "client_cpu_ms_per_request": round(1000 * cpu / n, 3),
            # What one uncontended client core sustains: the wall rate is meaningless on a shared, loaded host.
            "requests_per_client_cpu_s": round(n / cpu, 1) if cpu > 0 else None,
            # The test double's own cost: it must stay well below the client's or it is what is measured.
            "server_cpu_s": round(server_cpu, 3), "server_cpu_ms_per_request": round(1000 * server_cpu / n, 3)}


def _aiohttp_version() -> str:
    import aiohttp

    return aiohttp.__version__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: run the test double on this port
    args = ap.parse_args()
    if args.serve:
        InstantChatEndpoint.serve(args.serve)
        return
    port = _free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        _wait_listening(port)
        result = asyncio.run(_measure(f"http://127.0.0.1:{port}/v1", args.requests, args.concurrency, server.pid))
    finally:
        server.terminate()
        server.wait(10)
    result.update({
        "benchmark": "generate client overhead against InstantChatEndpoint (test double)",
        "concurrency": args.concurrency,
        "goal_requests_per_s": GOAL_RPS,
        # Wall rate: client and test double share the 2 cores (and, here, other people's work).
        "wall_ratio_to_goal": round(result["requests_per_s"] / GOAL_RPS, 2),
        "meets_goal_wall": result["requests_per_s"] >= GOAL_RPS,
        # Client-CPU rate: what one core spent on the client alone sustains.
        "client_cpu_ratio_to_goal": round((result["requests_per_client_cpu_s"] or 0) / GOAL_RPS, 2),
        "meets_goal_client_cpu": (result["requests_per_client_cpu_s"] or 0) >= GOAL_RPS,
        "client": "aiohttp " + _aiohttp_version(),
        "command": "python benchmarks/bench_generate_client.py " + " ".join(sys.argv[1:]),
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
    })
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
