"""Async client for an OpenAI-compatible ``/v1/chat/completions`` endpoint (aiohttp).

One retry policy (:class:`RetryPolicy`, named constants below): 429, 408, 5xx, timeouts
and connection errors are retried with exponential backoff and jitter (honouring
``Retry-After``); other 4xx raise :class:`NonRetryableError` at once. Credentials
rejected (401/403) raise :class:`CredentialsError`, which stops the whole run: every
other request would fail the same way. Requests run on a fixed pool of workers sharing
one ``aiohttp.ClientSession`` whose connector holds at most ``concurrency`` keep-alive
connections, and each prompt yields a :class:`ChatOutcome`: the response, or the error
that ended its retries.

aiohttp, not httpx: httpx/anyio spent ~2.6 ms of CPU per request against an endpoint
that answers instantly (``benchmarks/bench_generate_client.py``), more than a loaded
2-core pod can spare at the request rates a big served model sustains.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import urllib.request
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from yarl import URL

BACKOFF_BASE_S = 0.5  # first retry waits about this long
BACKOFF_MAX_S = 30.0  # no single wait is longer
BACKOFF_JITTER = 0.25  # each wait is scaled by a random factor in [1 - j, 1 + j]
CONNECT_TIMEOUT_S = 10.0
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
API_KEY_ENV = ("EAGLE3_API_KEY", "OPENAI_API_KEY")
# Failures of the transport itself (refused, reset, dropped mid-response, timed out): retried.
TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


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


def describe_transport_error(e: BaseException) -> str:
    """One line for a transport failure (timeouts have an empty ``str()``)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}".rstrip(": ")


def proxy_for(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTP(S)_PROXY`` unless ``NO_PROXY`` covers its host).

    Resolved once per client: aiohttp's ``trust_env`` re-reads the environment on every
    request, which doubled the client's CPU per request.
    """
    u = URL(url)
    if not u.host or urllib.request.proxy_bypass(u.host):
        return None
    return urllib.request.getproxies().get(u.scheme)


def _detail(status: int, reason: str | None, raw: bytes) -> str:
    """The endpoint's own error message from an error body, on one line (≤ 200 chars)."""
    try:
        body = json.loads(raw)
        d = (body.get("detail") or body.get("error") or body.get("message") or body) if isinstance(body, dict) else body
        if isinstance(d, dict):
            d = d.get("message") or json.dumps(d)
        text = str(d)
    except ValueError:
        text = raw.decode(errors="replace")
    return " ".join(text.split())[:200] or reason or f"status {status}"


def _retry_after(headers: Any) -> float | None:
    try:
        return float(headers["retry-after"])
    except (KeyError, ValueError):
        return None


class ChatClient:
    """Use as ``async with ChatClient(...) as client``: the session lives inside that block."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 600.0,
                 concurrency: int = 64, policy: RetryPolicy = RetryPolicy(), seed: int = 0) -> None:
        self.base_url = base_url.rstrip("/")
        self.concurrency, self.policy = concurrency, policy
        self._rng = random.Random(seed)
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s))
        self._models_url = URL(f"{self.base_url}/models")  # parsed once, not per request
        self._chat_url = URL(f"{self.base_url}/chat/completions")
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ChatClient:
        # Built inside the running loop (aiohttp binds the connector to it).
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.concurrency, limit_per_host=0),
            headers=self._headers, timeout=self._timeout, proxy=proxy_for(self.base_url))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("ChatClient is used outside `async with`")
        return self._session

    async def list_models(self) -> list[str]:
        """Ids the endpoint serves (``GET /models``): the preflight check before a run."""
        try:
            async with self.session.get(self._models_url) as r:
                status, reason, raw = r.status, r.reason, await r.read()
        except TRANSPORT_ERRORS as e:
            raise EndpointError(f"cannot reach {self._models_url}: {describe_transport_error(e)}") from None
        if status in (401, 403):
            raise CredentialsError(status, _detail(status, reason, raw))
        if status != 200:
            raise EndpointError(f"{self._models_url} answered HTTP {status}: {_detail(status, reason, raw)}")
        try:
            return [m["id"] for m in json.loads(raw)["data"]]
        except (ValueError, KeyError, TypeError):
            raise EndpointError(f"{self._models_url} did not answer an OpenAI model list") from None

    async def _post_once(self, payload: bytes) -> dict[str, Any]:
        async with self.session.post(self._chat_url, data=payload) as r:
            status, raw = r.status, await r.read()
            if status == 200:
                try:
                    body = json.loads(raw)
                    body["choices"][0]["message"]
                except (ValueError, KeyError, IndexError, TypeError):
                    raise NonRetryableError(200, "response is not a chat.completion") from None
                return body
            detail = _detail(status, r.reason, raw)
            if status in (401, 403):
                raise CredentialsError(status, detail)
            if status in RETRYABLE_STATUS or status >= 500:
                raise _Retryable(f"HTTP {status}: {detail}", _retry_after(r.headers))
            raise NonRetryableError(status, detail)

    async def complete(self, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """One chat completion with retries: (response body, attempts)."""
        payload = json.dumps(body, separators=(",", ":")).encode()
        for attempt in range(self.policy.max_retries + 1):
            try:
                return await self._post_once(payload), attempt + 1
            except _Retryable as e:
                last, retry_after = str(e), e.retry_after_s
            except TRANSPORT_ERRORS as e:
                last, retry_after = describe_transport_error(e), None
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

        async def worker() -> None:
            while True:
                try:
                    sample_id, messages = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    body, attempts = await self.complete(params.body(messages))
                    results.put_nowait(ChatOutcome(sample_id, body, None, attempts))
                except CredentialsError as e:
                    results.put_nowait(e)
                    return
                except EndpointError as e:
                    results.put_nowait(ChatOutcome(sample_id, None, str(e), self.policy.max_retries + 1
                                                   if isinstance(e, RetriesExhausted) else 1))
                except Exception as e:  # a bug, not an endpoint failure: surface it, never hang
                    results.put_nowait(e)
                    return

        total = queue.qsize()
        tasks = [asyncio.create_task(worker()) for _ in range(max(1, min(self.concurrency, total)))]
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
