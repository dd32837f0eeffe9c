"""A fault-injecting HTTP proxy for the S3 tests: what a flaky network and an overloaded
object store do to requests, on 127.0.0.1, in front of the moto S3 server.

Each request is, with probability ``rate`` (seeded, so a failing run can be replayed),
answered by the proxy itself with ``500 InternalError`` or ``503 SlowDown`` (S3's own error
bodies) without reaching the server, or forwarded and its response cut mid-body: the
status line, the headers (with the full Content-Length) and half the body, then the
connection is closed. Everything else is passed through byte for byte, the Host header
included, so SigV4 signatures still verify. ``counts`` says what was injected.

``rule(method, path)``, when given, picks a fault for a request by what it is (a path the test
watches for) before the random ones: one of the above, or ``"hold"``: the request is kept
unanswered until ``released`` is set, then answered 503 without reaching the server (a
process blocked in that request stays blocked, whatever happens around it, until the test
lets go). ``seen`` holds every request's ``(method, path)``, in order.
"""

from __future__ import annotations

import http.client
import random
import socketserver
import threading
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlparse

_ERRORS = {
    500: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
         b"<Message>We encountered an internal error. Please try again.</Message></Error>",
    503: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
         b"<Message>Please reduce your request rate.</Message></Error>",
}


class FaultProxy:
    """``with FaultProxy(upstream, rate=0.1) as proxy:`` then point the S3 endpoint at ``proxy.url``."""

    def __init__(self, upstream: str, rate: float = 0.1, seed: int = 0, kinds: tuple[str, ...] = ("500", "503", "cut"),
                 only: tuple[str, ...] = (), rule: Callable[[str, str], str | None] | None = None) -> None:
        self.upstream = urlparse(upstream)
        self.rate, self.kinds, self.only, self.rule = rate, kinds, only, rule
        self.released = threading.Event()
        self.seen: list[tuple[str, str]] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.scripted: list[str] = []  # faults to inject next, in order, before the random ones
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy._decide(self.command, self.path)
                if fault == "hold":
                    proxy.released.wait()
                    fault = "503"
                if fault in ("500", "503"):
                    err = _ERRORS[int(fault)]
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(err)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(err)
                    self.close_connection = True
                    return
                status, reason, headers, data = proxy._forward(self.command, self.path, self.headers, body)
                self.send_response(status, reason)
                for k, v in headers:
                    if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(k, v)
                # a HEAD's Content-Length is the object's, not the (empty) body's
                length = dict((k.lower(), v) for k, v in headers).get("content-length", "0")
                self.send_header("Content-Length", length if self.command == "HEAD" else str(len(data)))
                if fault == "cut" and len(data) > 1:
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.send_header("Connection", "keep-alive")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        class Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    def _decide(self, method: str, path: str) -> str | None:
        with self._lock:
            self.counts["requests"] += 1
            self.seen.append((method, path))
            fault = self.rule(method, path) if self.rule is not None else None
            if fault is not None:
                self.counts[fault] += 1
                self.counts["faults"] += 1
                return fault
            if self.only and method not in self.only:
                return None
            if self.scripted:
                fault = self.scripted.pop(0)
            elif self._rng.random() < self.rate:
                fault = self._rng.choice(self.kinds)
            else:
                return None
            if fault == "cut" and method == "HEAD":
                fault = "503"  # a HEAD has no body to cut
            self.counts[fault] += 1
            self.counts["faults"] += 1
            return fault

    def _forward(self, method: str, path: str, headers: object, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=120)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for k, v in headers.items():  # type: ignore[attr-defined]
                if k.lower() not in ("connection", "content-length"):
                    conn.putheader(k, v)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            r = conn.getresponse()
            data = r.read()
            return r.status, r.reason, r.getheaders(), data
        finally:
            conn.close()

    def __enter__(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.released.set()
        self._server.shutdown()
        self._server.server_close()
