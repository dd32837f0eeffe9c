"""Async client for an OpenAI-compatible ``/v1/chat/completions`` endpoint.

One retry policy (:class:`RetryPolicy`, named constants below): 429, 408, 5xx, timeouts
and connection errors are retried with exponential backoff and jitter (honouring
``Retry-After``); other 4xx raise :class:`NonRetryableError` at once. Credentials
rejected (401/403) raise :class:`CredentialsError`, which stops the whole run: every
other request would fail the same way. Requests run on a fixed pool of workers (bounded
concurrency, HTTP/1.1 keep-alive), and each prompt yields a :class:`ChatOutcome`: the
response, or the error that ended its retries.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import ssl
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

BACKOFF_BASE_S = 0.5  # first retry waits about this long
BACKOFF_MAX_S = 30.0  # no single wait is longer
BACKOFF_JITTER = 0.25  # each wait is scaled by a random factor in [1 - j, 1 + j]
CONNECT_TIMEOUT_S = 10.0
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
API_KEY_ENV = ("EAGLE3_API_KEY", "OPENAI_API_KEY")


class EndpointError(Exception):
    """A request failed; ``str()`` is the one-line reason recorded for the sample."""


class NonRetryableError(EndpointError):
    """The endpoint refused the request itself (4xx other than 408/429): retrying cannot help."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


class CredentialsError(NonRetryableError):
    """401/403: the endpoint rejected our credentials (fatal for the run)."""


class RetriesExhausted(EndpointError):
    """A retryable failure persisted through every retry."""


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 5
    base_s: float = BACKOFF_BASE_S
    max_s: float = BACKOFF_MAX_S
    jitter: float = BACKOFF_JITTER

    def delay(self, retry: int, rng: random.Random, retry_after_s: float | None = None) -> float:
        """Wait before retry number ``retry`` (0-based): base·2^retry, capped, jittered; ≥ Retry-After."""
        d = min(self.max_s, self.base_s * (2 ** retry)) * (1 + self.jitter * (2 * rng.random() - 1))
        return max(d, min(retry_after_s, self.max_s)) if retry_after_s is not None else d


@dataclass
class ChatOutcome:
    sample_id: int
    response: dict[str, Any] | None  # the parsed chat.completion body
    error: str | None = None
    attempts: int = 1


@dataclass
class ChatParams:
    model: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        b = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
             "temperature": self.temperature, "top_p": self.top_p, **self.extra}
        if self.seed is not None:
            b["seed"] = self.seed
        return b


def api_key_from_env() -> str | None:
    return next((os.environ[k] for k in API_KEY_ENV if os.environ.get(k)), None)


def _detail(r: httpx.Response) -> str:
    try:
        body = r.json()
        d = body.get("detail") or body.get("error") or body.get("message") or body
        if isinstance(d, dict):
            d = d.get("message") or json.dumps(d)
        text = str(d)
    except ValueError:
        text = r.text
    return " ".join(text.split())[:200] or r.reason_phrase


def _retry_after(r: httpx.Response) -> float | None:
    try:
        return float(r.headers["retry-after"])
    except (KeyError, ValueError):
        return None


class ChatClient:
    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 600.0,
                 concurrency: int = 64, policy: RetryPolicy = RetryPolicy(), seed: int = 0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.concurrency, self.policy = concurrency, policy
        self._rng = random.Random(seed)
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._timeout = httpx.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s))
        self._transport = transport
        self._ssl = ssl.create_default_context()  # built once: loading CA certs costs ~0.1 s per client
        self._http = self._new_http(concurrency)

    def _new_http(self, connections: int) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=self._timeout, transport=self._transport, verify=self._ssl,
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        )

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._http.aclose()

    async def list_models(self) -> list[str]:
        """Ids the endpoint serves (``GET /models``): the preflight check before a run."""
        try:
            r = await self._http.get("/models")
        except httpx.HTTPError as e:
            raise EndpointError(f"cannot reach {self.base_url}/models: {type(e).__name__}: {e}".rstrip(": ")) from None
        if r.status_code in (401, 403):
            raise CredentialsError(r.status_code, _detail(r))
        if r.status_code != 200:
            raise EndpointError(f"{self.base_url}/models answered HTTP {r.status_code}: {_detail(r)}")
        try:
            return [m["id"] for m in r.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise EndpointError(f"{self.base_url}/models did not answer an OpenAI model list") from None

    async def _post_once(self, http: httpx.AsyncClient, payload: bytes) -> dict[str, Any]:
        r = await http.post("/chat/completions", content=payload)
        if r.status_code == 200:
            try:
                body = json.loads(r.content)
                body["choices"][0]["message"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise NonRetryableError(200, "response is not a chat.completion") from None
            return body
        if r.status_code in (401, 403):
            raise CredentialsError(r.status_code, _detail(r))
        if r.status_code in RETRYABLE_STATUS or r.status_code >= 500:
            raise _Retryable(f"HTTP {r.status_code}: {_detail(r)}", _retry_after(r))
        raise NonRetryableError(r.status_code, _detail(r))

    async def complete(self, body: dict[str, Any], http: httpx.AsyncClient | None = None) -> tuple[dict[str, Any], int]:
        """One chat completion with retries: (response body, attempts)."""
        payload = json.dumps(body, separators=(",", ":")).encode()
        for attempt in range(self.policy.max_retries + 1):
            try:
                return await self._post_once(http or self._http, payload), attempt + 1
            except _Retryable as e:
                last, retry_after = str(e), e.retry_after_s
            except (httpx.TimeoutException, httpx.TransportError) as e:
                last, retry_after = f"{type(e).__name__}: {e}".rstrip(": "), None
            if attempt < self.policy.max_retries:
                await asyncio.sleep(self.policy.delay(attempt, self._rng, retry_after))
        raise RetriesExhausted(f"{last} (after {self.policy.max_retries + 1} attempts)")

    async def run(self, jobs: Iterable[tuple[int, list[dict[str, str]]]], params: ChatParams) -> AsyncIterator[ChatOutcome]:
        """Outcomes in completion order; at most ``concurrency`` requests in flight.

        A :class:`CredentialsError` stops the run and is raised to the caller.
        """
        queue: asyncio.Queue = asyncio.Queue()
        for job in jobs:
            queue.put_nowait(job)
        results: asyncio.Queue = asyncio.Queue()
        n_workers = max(1, min(self.concurrency, queue.qsize()))

        async def worker() -> None:
            # Each worker owns a one-connection pool: httpcore's shared pool scans every
            # connection on every request (O(concurrency) per request), which capped the
            # client near 30 requests/s at concurrency 64; private pools keep it O(1).
            async with self._new_http(1) as http:
                await work(http)

        async def work(http: httpx.AsyncClient) -> None:
            while True:
                try:
                    sample_id, messages = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    body, attempts = await self.complete(params.body(messages), http)
                    await results.put(ChatOutcome(sample_id, body, None, attempts))
                except CredentialsError as e:
                    await results.put(e)
                    return
                except EndpointError as e:
                    await results.put(ChatOutcome(sample_id, None, str(e), self.policy.max_retries + 1
                                                  if isinstance(e, RetriesExhausted) else 1))
                except Exception as e:  # a bug, not an endpoint failure: surface it, never hang
                    await results.put(e)
                    return

        total = queue.qsize()
        tasks = [asyncio.create_task(worker()) for _ in range(n_workers)]
        try:
            for _ in range(total):
                item = await results.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class _Retryable(Exception):
    def __init__(self, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
