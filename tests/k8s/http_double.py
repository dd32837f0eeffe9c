"""ApiHttpDouble: ApiServerDouble behind the Kubernetes REST API on 127.0.0.1 (a test double).

It speaks the API's paths and verbs as the official client sends them (GET/POST/PUT/DELETE on
/api/v1/… and /apis/GROUP/VERSION/…, ?watch=true streams, pods/log, SelfSubjectAccessReview),
answers errors as Status objects with their HTTP codes, and streams watches as the real server
does: newline-delimited events in a chunked 200 response, a too-old resourceVersion as an ERROR
event carrying a 410 Status. Every request must carry the ServiceAccount's bearer token; the
Role the double enforces is the chart's rendered one.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from eagle3.k8s.kube import AlreadyExists, Conflict, Forbidden, Gone, Invalid, KubeError, NotFound
from tests.k8s.apiserver_double import API_VERSIONS, KINDS, ApiServerDouble, BadRequest

TOKEN = "sa-token"
REASONS = {NotFound: "NotFound", AlreadyExists: "AlreadyExists", Conflict: "Conflict", Forbidden: "Forbidden",
           Invalid: "Invalid", BadRequest: "BadRequest", Gone: "Expired"}
_BY_PATH = {(group, resource): kind for kind, (group, resource) in KINDS.items() if "/" not in resource}


def status(code: int, message: str, reason: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure" if code >= 400 else "Success",
            "message": message, "reason": reason, "code": code}


def _bool(v: str | None) -> bool:
    return (v or "").lower() in ("1", "t", "true")


class ApiHttpDouble:
    """Start with ``with ApiHttpDouble(server) as api: api.url``; ``requests`` records (method, path)."""

    def __init__(self, server: ApiServerDouble) -> None:
        self.server = server
        self.lock = threading.RLock()
        self.requests: list[tuple[str, str]] = []
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms Nagle stalls

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                double.handle(self, "GET")

            def do_POST(self) -> None:
                double.handle(self, "POST")

            def do_PUT(self) -> None:
                double.handle(self, "PUT")

            def do_DELETE(self) -> None:
                double.handle(self, "DELETE")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> ApiHttpDouble:
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- plumbing
    @staticmethod
    def _send(h: BaseHTTPRequestHandler, code: int, body: dict | str, content_type: str = "application/json") -> None:
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        h.send_response(code)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    @staticmethod
    def _chunk(h: BaseHTTPRequestHandler, data: bytes) -> None:
        h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        h.wfile.flush()

    def _route(self, path: str) -> tuple[str, str, str | None, str | None]:
        """(kind, namespace, name, subresource) of a namespaced path; BadRequest/NotFound otherwise."""
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "v1"]:
            group, rest = "", parts[2:]
        elif parts[0] == "apis" and len(parts) > 3:
            group, rest = parts[1], parts[3:]
            if API_VERSIONS.get(group) != f"{group}/{parts[2]}":
                raise NotFound(f"the server could not find the requested resource ({path})", 404)
        else:
            raise NotFound(f"the server could not find the requested resource ({path})", 404)
        if len(rest) < 3 or rest[0] != "namespaces":
            raise NotFound(f"the server could not find the requested resource ({path})", 404)
        ns, plural, name, sub = rest[1], rest[2], (rest[3] if len(rest) > 3 else None), (rest[4] if len(rest) > 4 else None)
        kind = _BY_PATH.get((group, plural))
        if kind is None:
            raise NotFound(f"the server could not find the requested resource ({path})", 404)
        if sub is not None and (kind, sub) != ("Pod", "log"):
            raise NotFound(f"the server could not find the requested resource ({path})", 404)
        return ("PodLog" if sub else kind), ns, name, sub

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(h.path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self.requests.append((method, url.path))
        length = int(h.headers.get("Content-Length") or 0)
        body = json.loads(h.rfile.read(length) or b"{}") if length else {}
        if h.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._send(h, 401, status(401, "Unauthorized", "Unauthorized"))
            return
        try:
            if url.path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews" and method == "POST":
                self._send(h, 201, self._access_review(body))
                return
            kind, ns, name, sub = self._route(url.path)
            if ns != self.server.namespace:
                raise Forbidden(f'cannot access namespace "{ns}"', 403)
            if method == "GET" and _bool(q.get("watch")):
                self._watch(h, kind, q)
                return
            with self.lock:
                code, out = self._call(method, kind, name, q, body)
            if isinstance(out, str):
                self._send(h, code, out, "text/plain")
            else:
                self._send(h, code, out)
        except KubeError as e:
            code = e.status or 500
            self._send(h, code, status(code, str(e), REASONS.get(type(e), "InternalError")))

    def _call(self, method: str, kind: str, name: str | None, q: dict, body: dict) -> tuple[int, dict | str]:
        s = self.server
        if kind == "PodLog":
            tail = int(q["tailLines"]) if "tailLines" in q else None
            return 200, "".join(f"{line}\n" for line in s.logs(name, tail))
        group = KINDS[kind][0]
        if method == "GET" and name is None:
            items, rv = s.list(kind, q.get("labelSelector"), q.get("fieldSelector"))
            return 200, {"kind": f"{kind}List", "apiVersion": API_VERSIONS[group], "metadata": {"resourceVersion": rv},
                         "items": items}
        if method == "GET":
            return 200, s.get(kind, name)
        if method == "POST" and name is None:
            if body.get("kind") != kind or body.get("apiVersion") != API_VERSIONS[group]:
                raise BadRequest(f"the API version in the data ({body.get('apiVersion')}) does not match the expected "
                                 f"API version ({API_VERSIONS[group]})", 400)
            return 201, s.create(body)
        if method == "PUT" and name is not None:
            if body.get("metadata", {}).get("name") != name:
                raise BadRequest("the name of the object does not match the name on the URL", 400)
            return 200, s.update(body)
        if method == "DELETE" and name is not None:
            s.delete(kind, name, body.get("propagationPolicy") or "Background")
            return 200, status(200, "", "") | {"status": "Success", "details": {"name": name, "kind": KINDS[kind][1]}}
        raise KubeError(f"{method} is not supported here", 405)

    def _watch(self, h: BaseHTTPRequestHandler, kind: str, q: dict) -> None:
        """The events after resourceVersion, then the stream ends (a real server would hold it
        open up to timeoutSeconds; ending early is allowed and the client watches again)."""
        with self.lock:  # RBAC and selectors are checked before the stream starts, as the server does
            events = self.server.watch(kind, q.get("resourceVersion", ""), q.get("labelSelector"), q.get("fieldSelector"))
            out = []
            try:
                for event in events:
                    out.append(event)
            except Gone as e:  # too old, or cut off mid-stream: an ERROR event with a 410 Status
                out.append(("ERROR", status(410, str(e), "Expired")))
            except KubeError as e:
                if out:
                    raise
                self._send(h, e.status, status(e.status, str(e), REASONS.get(type(e), "InternalError")))
                return
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for typ, obj in out:
            self._chunk(h, (json.dumps({"type": typ, "object": obj}) + "\n").encode())
        self._chunk(h, b"")

    def _access_review(self, body: dict) -> dict:
        attrs = body["spec"]["resourceAttributes"]
        resource = attrs["resource"] + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")
        allowed = attrs.get("namespace") == self.server.namespace and self.server.allowed(attrs["verb"], attrs.get("group", ""), resource)
        return {**body, "status": {"allowed": allowed}}
