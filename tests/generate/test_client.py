"""The chat client's retry policy and error types, against a scripted endpoint."""

from __future__ import annotations

import asyncio
import random

import pytest
from aiohttp import web

from eagle3.generate.client import (
    ChatClient, ChatParams, CredentialsError, EndpointError, NonRetryableError, RetriesExhausted, RetryPolicy,
    proxy_for,
)

FAST = RetryPolicy(max_retries=3, base_s=0.001, max_s=0.01, jitter=0.25)


class ScriptedEndpoint:
    """Test double: an OpenAI endpoint (a real aiohttp server on 127.0.0.1) answering from a per-prompt script.

    ``script[prompt]`` is a list of steps returned in turn: a status code, "drop" (the
    connection is closed without an answer) or "stall" (no answer within the client's
    timeout). Once exhausted, it answers 200 with a completion echoing the prompt.
    """


    def __init__(self, script: dict[str, list] | None = None) -> None:
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.calls: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        self.auth_headers: list[str | None] = []
        self.base_url = ""
        self._runner: web.AppRunner | None = None
        self._closing = asyncio.Event()

    async def __aenter__(self) -> ScriptedEndpoint:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.base_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"
        return self

    async def __aexit__(self, *exc) -> None:
        self._closing.set()  # release stalled handlers so shutdown need not wait for them
        await self._runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
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
                    request.transport.close()
                    return web.Response()
                if step == "stall":  # no answer at all, until the endpoint closes
                    await self._closing.wait()
                    return web.Response()
                if step == "not-chat":
                    return web.json_response({"object": "list"})
                return web.json_response({"detail": f"scripted {step}"}, status=step, headers={"retry-after": "0"})
            return web.json_response({
                "choices": [{"message": {"role": "assistant", "content": f"re: {prompt}"}, "finish_reason": "stop"}],
                "usage": {"completion_tokens": 2}})
        finally:
            self.in_flight -= 1


async def _run_async(endpoint: ScriptedEndpoint, prompts: list[str], **kw):
    async with endpoint:
        async with ChatClient(endpoint.base_url, policy=kw.pop("policy", FAST), **kw) as c:
            jobs = [(i, [{"role": "user", "content": p}]) for i, p in enumerate(prompts)]
            return {o.sample_id: o async for o in c.run(jobs, ChatParams(model="m", max_tokens=4))}


def _run(endpoint: ScriptedEndpoint, prompts: list[str], **kw):
    return asyncio.run(_run_async(endpoint, prompts, **kw))


def test_retries_429_5xx_and_connection_errors():
    ep = ScriptedEndpoint({"a": [429, 503], "b": ["drop", 500], "c": []})
    out = _run(ep, ["a", "b", "c"])
    assert {i: (o.error, o.attempts) for i, o in out.items()} == {0: (None, 3), 1: (None, 3), 2: (None, 1)}
    assert out[0].response["choices"][0]["message"]["content"] == "re: a"


def test_timeouts_are_retried():
    ep = ScriptedEndpoint({"slow": ["stall"]})
    # the stall never answers; the timeout is far above what an answer takes, however loaded the machine
    out = _run(ep, ["slow"], timeout_s=2.0)
    assert out[0].error is None and out[0].attempts == 2 and ep.calls["slow"] == 2


def test_a_200_that_is_not_a_chat_completion_is_not_retried():
    ep = ScriptedEndpoint({"odd": ["not-chat"]})
    out = _run(ep, ["odd"])
    assert out[0].error == "HTTP 200: response is not a chat.completion" and ep.calls["odd"] == 1


def test_4xx_is_not_retried_and_recorded_per_sample():
    ep = ScriptedEndpoint({"bad": [400]})
    out = _run(ep, ["bad", "good"])
    assert out[0].response is None and out[0].error == "HTTP 400: scripted 400" and ep.calls["bad"] == 1
    assert out[1].error is None


def test_retries_exhausted_is_a_sample_error():
    ep = ScriptedEndpoint({"x": [503] * 10})
    out = _run(ep, ["x"])
    assert ep.calls["x"] == 4 and out[0].attempts == 4
    assert out[0].error == "HTTP 503: scripted 503 (after 4 attempts)"


def test_credentials_rejected_stops_the_run():
    ep = ScriptedEndpoint({"a": [401]})
    with pytest.raises(CredentialsError):
        _run(ep, ["a"] + [f"p{i}" for i in range(20)], concurrency=2)


def test_api_key_is_sent_as_bearer():
    ep = ScriptedEndpoint()
    _run(ep, ["a"], api_key="sekrit")
    assert ep.auth_headers == ["Bearer sekrit"]


def test_concurrency_is_bounded():
    ep = ScriptedEndpoint()
    out = _run(ep, [f"p{i}" for i in range(40)], concurrency=5)
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
    unreachable = r"cannot reach http://127.0.0.1:9/v1/models: ClientConnectorError: Cannot connect to host 127.0.0.1:9"
    with pytest.raises(EndpointError, match=unreachable):
        asyncio.run(go())


def test_proxy_from_the_environment_unless_no_proxy(monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.internal:3128")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,.svc")
    for name in ("http_proxy", "no_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert proxy_for("http://vllm.example.com:8000/v1") == "http://proxy.internal:3128"
    assert proxy_for("http://vllm.ns.svc:8000/v1") is None and proxy_for("http://127.0.0.1:8000/v1") is None
    assert proxy_for("https://vllm.example.com/v1") is None  # no HTTPS_PROXY set


def test_error_types():
    assert issubclass(CredentialsError, NonRetryableError) and issubclass(RetriesExhausted, EndpointError)
