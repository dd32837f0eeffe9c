"""`transformers serve` running a tiny target: a real OpenAI-compatible endpoint."""

from __future__ import annotations

import httpx
import pytest

from eagle3.serve.local import transformers_serve_command
from eagle3.settings.serve import ServeSettings
from eagle3.settings.target import TargetSettings


def test_command_pins_the_resolved_target(tiny_llama_dir):
    cmd = transformers_serve_command(TargetSettings(model=str(tiny_llama_dir)), ServeSettings(host="0.0.0.0", port=9123))
    assert cmd.argv[1] == "serve" and cmd.argv[-1] == str(tiny_llama_dir.resolve())
    assert cmd.argv[cmd.argv.index("--port") + 1] == "9123"
    assert cmd.base_url == "http://127.0.0.1:9123/v1"
    assert cmd.env["HF_HUB_OFFLINE"] == "1" and cmd.env["HF_HUB_DISABLE_UPDATE_CHECK"] == "1"


@pytest.mark.slow
def test_serves_chat_completions(tiny_server):
    served = tiny_server("llama")
    models = httpx.get(f"{served.base_url}/models", timeout=None).json()
    assert [m["id"] for m in models["data"]] == [served.model]
    r = httpx.post(f"{served.base_url}/chat/completions", timeout=None, json={
        "model": served.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
    body = r.json()
    assert r.status_code == 200, body
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert body["usage"]["completion_tokens"] <= 4
    other = httpx.post(f"{served.base_url}/chat/completions", timeout=None, json={
        "model": "other", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert other.status_code == 400  # pinned: requests must name the served model
