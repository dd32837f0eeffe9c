"""Settings of the serve stage: the OpenAI-compatible endpoint that generate calls."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

_URL = re.compile(r"^https?://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(:\d{1,5})?(/[^\s]*)?$")


def check_endpoint_url(value: str) -> str:
    """An OpenAI-compatible base URL: http(s)://host[:port][/path]; ValueError naming what is wrong."""
    if "://" not in value:
        raise ValueError(f"{value!r} has no scheme: write http://{value}")
    if not _URL.match(value):
        raise ValueError(f"{value!r} is not an http(s)://HOST[:PORT][/PATH] URL")
    port = value.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)
    if len(port) == 2 and port[1].isdigit() and not 0 < int(port[1]) < 65536:
        raise ValueError(f"{value!r}: port {port[1]} is out of range")
    return value.rstrip("/")


class ServeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    endpoint: str | None = Field(
        None, description="Use an already running OpenAI-compatible endpoint (base URL ending in /v1); "
        "when set, eagle3ctl starts and stops no server."
    )
    engine: str = Field("auto", pattern="^(auto|vllm|transformers)$",
                        description="auto: vLLM when installed and a GPU is present, else `transformers serve`.")
    host: str = Field("127.0.0.1", description="Local backend: interface the server binds.")
    port: int | None = Field(None, ge=1, le=65535, description="Port the server listens on; unset: a free port "
                             "(local backend) or 8000 (the vLLM Service on Kubernetes).")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM --tensor-parallel-size (8 for Kimi-K2.5 on one node).")
    max_model_len: int | None = Field(None, ge=1, description="vLLM --max-model-len.")
    reasoning_parser: str | None = Field(None, description="vLLM --reasoning-parser (kimi_k2 for Kimi-K2.5).")
    extra_args: list[str] = Field(default_factory=list, description="Extra arguments appended to the server command.")
    startup_timeout_s: float = Field(1800, gt=0, description="How long to wait for /v1/models to answer.")

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return None if v is None else check_endpoint_url(v)
