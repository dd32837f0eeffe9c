"""Settings of the serve stage: the OpenAI-compatible endpoint that generate calls."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ServeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    endpoint: str | None = Field(
        None, description="Use an already running OpenAI-compatible endpoint (base URL ending in /v1); "
        "when set, eagle3ctl starts and stops no server."
    )
    engine: str = Field("auto", pattern="^(auto|vllm|transformers)$",
                        description="auto: vLLM when installed and a GPU is present, else `transformers serve`.")
    host: str = Field("127.0.0.1", description="Local backend: interface the server binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port the server listens on.")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM --tensor-parallel-size (8 for Kimi-K2.5 on one node).")
    max_model_len: int | None = Field(None, ge=1, description="vLLM --max-model-len.")
    reasoning_parser: str | None = Field(None, description="vLLM --reasoning-parser (kimi_k2 for Kimi-K2.5).")
    extra_args: list[str] = Field(default_factory=list, description="Extra arguments appended to the server command.")
    startup_timeout_s: float = Field(1800, gt=0, description="How long to wait for /v1/models to answer.")
