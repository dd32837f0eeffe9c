"""A minimal OpenAI-compatible server that batches requests into HF greedy ``generate``.

The benchmark machine has no vLLM, and ``transformers serve`` answers one request at a
time, which is far too slow for thousands of samples. This server stands in for vLLM in
the benchmark only: it speaks the same endpoints (``/v1/models``,
``/v1/chat/completions``, ``/v1/completions``) so the real generate stage runs unchanged
against it, and it batches whatever requests are waiting (up to ``--max-batch``) into one
left-padded ``model.generate`` call. Prompts are rendered with the target's own chat
template, exactly as vLLM would.
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class Batcher:
    """Collects requests from handler threads; one worker thread runs batched generate."""

    def __init__(self, model, tokenizer, device: torch.device, max_batch: int, wait_s: float = 0.1,
                 max_wait_s: float = 3.0):
        self.model, self.tok, self.device = model, tokenizer, device
        self.max_batch, self.wait_s, self.max_wait_s = max_batch, wait_s, max_wait_s
        self.q: queue.Queue = queue.Queue()
        self.generated_tokens = 0
        self.batches = 0
        threading.Thread(target=self._loop, daemon=True).start()

    def submit(self, ids: list[int], max_tokens: int) -> Future:
        fut: Future = Future()
        self.q.put((ids, max_tokens, fut))
        return fut

    def _take(self) -> list:
        """A batch: requests keep joining until ``max_batch``, a gap of ``wait_s`` with no new
        request, or ``max_wait_s`` after the first. Every generate call costs the full
        ``max_tokens`` steps whatever its size, so a wave of requests still arriving (the
        client's next 1,024 after a batch finished, each rendered by a handler thread) must
        be gathered whole, not cut after a fixed 50 ms into many small batches."""
        items = [self.q.get()]
        last_deadline = time.monotonic() + self.max_wait_s
        while len(items) < self.max_batch:
            left = min(self.wait_s, last_deadline - time.monotonic())
            if left <= 0:
                break
            try:
                items.append(self.q.get(timeout=left))
            except queue.Empty:
                break
        return items

    def _loop(self) -> None:
        while True:
            items = self._take()
            try:
                t0 = time.monotonic()
                outs = self._generate([i[0] for i in items], max(i[1] for i in items))
                print(f"serve_batched: batch {self.batches} of {len(items)} requests, "
                      f"{sum(len(t) for t, _ in outs)} tokens in {time.monotonic() - t0:.1f}s", flush=True)
                for (ids, max_tokens, fut), (toks, stopped) in zip(items, outs):
                    finish = "stop" if stopped and len(toks) <= max_tokens else "length"
                    fut.set_result((toks[:max_tokens], finish))
            except Exception as e:  # noqa: BLE001 - answered to every waiting request as a 500
                for *_, fut in items:
                    fut.set_exception(e)

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], max_new: int) -> list[tuple[list[int], bool]]:
        pad, eos = self.tok.pad_token_id, self.tok.eos_token_id
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every row ends at the last column
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=max_new, do_sample=False, pad_token_id=pad, eos_token_id=eos)
        new = out[:, width:].tolist()  # [B, <=max_new]
        self.batches += 1
        res = []
        for row in new:
            stopped = eos in row
            toks = row[: row.index(eos)] if stopped else row
            self.generated_tokens += len(toks)
            res.append((toks, stopped))
        return res


class BatchingHTTPServer(ThreadingHTTPServer):
    """``socketserver`` listens with a backlog of 5: a client opening hundreds of connections at
    once (generate's concurrency) overflows it, the kernel drops the SYNs, and each dropped
    connection waits out TCP's retransmit backoff (1, 3, 7, 15, 31 s ...) while the GPU idles."""

    request_queue_size = 4096
    daemon_threads = True


def make_handler(batcher: Batcher, served_name: str):
    tok = batcher.tok

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: thousands of requests
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                self._send(200, {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "bench"}]})
            elif self.path.rstrip("/") in ("/health", "/v1/health"):
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            except json.JSONDecodeError:
                return self._send(400, {"error": {"message": "body is not JSON"}})
            chat = self.path.rstrip("/").endswith("/chat/completions")
            if not chat and not self.path.rstrip("/").endswith("/completions"):
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            if chat:
                text = tok.apply_chat_template(req.get("messages") or [], tokenize=False, add_generation_prompt=True)
            else:
                text = req.get("prompt") or ""
            ids = tok(text, add_special_tokens=False)["input_ids"]
            max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or 256)
            try:
                toks, finish = batcher.submit(ids, max_tokens).result()
            except Exception as e:  # noqa: BLE001
                return self._send(500, {"error": {"message": f"generation failed: {e}"}})
            content = tok.decode(toks, skip_special_tokens=True)
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(toks), "total_tokens": len(ids) + len(toks)}
            base = {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "created": int(time.time()), "model": served_name, "usage": usage}
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": content, "reasoning_content": None},
                          "finish_reason": finish}
                return self._send(200, {**base, "object": "chat.completion", "choices": [choice]})
            return self._send(200, {**base, "object": "text_completion",
                                    "choices": [{"index": 0, "text": content, "finish_reason": finish}]})

    return Handler


def load(model_dir: str, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def serve(model_dir: str, host: str, port: int, max_batch: int, device: torch.device, served_name: str | None = None):
    """Start serving in a background thread; returns (server, batcher)."""
    model, tok = load(model_dir, device)
    batcher = Batcher(model, tok, device, max_batch)
    server = BatchingHTTPServer((host, port), make_handler(batcher, served_name or model_dir))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, batcher


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--served-name", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    server, _ = serve(args.model, args.host, args.port, args.max_batch, torch.device(args.device), args.served_name)
    print(f"serving {args.model} on http://{args.host}:{args.port}/v1", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
