"""The chat client's retry policy and error types, against a scripted endpoint."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from eagle3.data.client import (
    ChatClient, ChatParams, CredentialsError, EndpointError, NonRetryableError, RetriesExhausted, RetryPolicy,
)

FAST = RetryPolicy(max_retries=3, base_s=0.001, max_s=0.01, jitter=0.25)


class ScriptedEndpoint:
    """Test double: an OpenAI endpoint (httpx MockTransport) answering from a per-prompt script.

    ``script[prompt]`` is a list of status codes (or "drop" for a connection error) returned
    in turn; once exhausted, it answers 200 with a completion echoing the prompt.
    """

    def __init__(self, script: dict[str, list] | None = None) -> None:
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.calls: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        self.auth_headers: list[str | None] = []

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        prompt = body["messages"][-1]["content"]
        self.calls[prompt] = self.calls.get(prompt, 0) + 1
        self.auth_headers.append(request.headers.get("authorization"))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.002)
            steps = self.script.get(prompt)
            if steps:
                step = steps.pop(0)
                if step == "drop":
                    raise httpx.ConnectError("connection refused", request=request)
                return httpx.Response(step, json={"detail": f"scripted {step}"}, headers={"retry-after": "0"})
            return httpx.Response(200, json={
                "choices": [{"message": {"role": "assistant", "content": f"re: {prompt}"}, "finish_reason": "stop"}],
                "usage": {"completion_tokens": 2}})
        finally:
            self.in_flight -= 1

    def client(self, **kw) -> ChatClient:
        return ChatClient("http://test/v1", transport=httpx.MockTransport(self.handler), policy=kw.pop("policy", FAST), **kw)


async def _run(endpoint: ScriptedEndpoint, prompts: list[str], **kw):
    async with endpoint.client(**kw) as c:
        jobs = [(i, [{"role": "user", "content": p}]) for i, p in enumerate(prompts)]
        return {o.sample_id: o async for o in c.run(jobs, ChatParams(model="m", max_tokens=4))}


def test_retries_429_5xx_and_connection_errors():
    ep = ScriptedEndpoint({"a": [429, 503], "b": ["drop", 500], "c": []})
    out = asyncio.run(_run(ep, ["a", "b", "c"]))
    assert {i: (o.error, o.attempts) for i, o in out.items()} == {0: (None, 3), 1: (None, 3), 2: (None, 1)}
    assert out[0].response["choices"][0]["message"]["content"] == "re: a"


def test_4xx_is_not_retried_and_recorded_per_sample():
    ep = ScriptedEndpoint({"bad": [400]})
    out = asyncio.run(_run(ep, ["bad", "good"]))
    assert out[0].response is None and out[0].error == "HTTP 400: scripted 400" and ep.calls["bad"] == 1
    assert out[1].error is None


def test_retries_exhausted_is_a_sample_error():
    ep = ScriptedEndpoint({"x": [503] * 10})
    out = asyncio.run(_run(ep, ["x"]))
    assert ep.calls["x"] == 4 and out[0].attempts == 4
    assert out[0].error == "HTTP 503: scripted 503 (after 4 attempts)"


def test_credentials_rejected_stops_the_run():
    ep = ScriptedEndpoint({"a": [401]})
    with pytest.raises(CredentialsError):
        asyncio.run(_run(ep, ["a"] + [f"p{i}" for i in range(20)], concurrency=2))


def test_api_key_is_sent_as_bearer():
    ep = ScriptedEndpoint()
    asyncio.run(_run(ep, ["a"], api_key="sekrit"))
    assert ep.auth_headers == ["Bearer sekrit"]


def test_concurrency_is_bounded():
    ep = ScriptedEndpoint()
    out = asyncio.run(_run(ep, [f"p{i}" for i in range(40)], concurrency=5))
    assert len(out) == 40 and all(o.error is None for o in out.values())
    assert ep.max_in_flight == 5


def test_backoff_grows_is_capped_and_jittered():
    p = RetryPolicy(base_s=1.0, max_s=8.0, jitter=0.25)
    rng = random.Random(0)
    for retry, nominal in [(0, 1.0), (1, 2.0), (2, 4.0), (3, 8.0), (6, 8.0)]:
        d = p.delay(retry, rng)
        assert nominal * 0.75 <= d <= nominal * 1.25
    assert p.delay(0, rng, retry_after_s=5.0) == 5.0  # Retry-After wins when longer
    assert p.delay(0, rng, retry_after_s=100.0) == 8.0  # but never past the cap


def test_list_models_unreachable_is_endpoint_error():
    async def go():
        async with ChatClient("http://127.0.0.1:9/v1", policy=FAST) as c:
            await c.list_models()
    with pytest.raises(EndpointError, match="cannot reach http://127.0.0.1:9/v1/models: ConnectError"):
        asyncio.run(go())


def test_error_types():
    assert issubclass(CredentialsError, NonRetryableError) and issubclass(RetriesExhausted, EndpointError)
