"""Settings of the generate stage: prompts in, target responses and tokenized samples out."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GenerateSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: str = Field("builtin:tiny-prompts", description="Prompts file (JSONL: chat messages, {\"prompt\": ...} "
                         "or ShareGPT conversations): a local path, an s3:// URI, or builtin:tiny-prompts.")
    max_samples: int | None = Field(None, ge=1, description="Use at most this many prompts.")
    concurrency: int = Field(64, ge=1, description="Requests in flight at once.")
    max_tokens: int = Field(2048, ge=1, description="max_tokens per completion.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature (0 = greedy: the drafter learns the target's own choices).")
    top_p: float = Field(1.0, gt=0, le=1)
    request_timeout_s: float = Field(600, gt=0, description="Timeout of one request.")
    max_retries: int = Field(5, ge=0, description="Retries on 429, 5xx and connection errors, with exponential backoff.")
    max_length: int = Field(4096, ge=8, description="Maximum tokens of a tokenized sample (prompt + response).")
    drop_truncated: bool = Field(True, description="Exclude samples longer than max_length (else cut them).")
    require_reasoning: bool = Field(False, description="Exclude responses that carry no reasoning.")
    system_prompt: str | None = Field(None, description="System message prepended to prompts that have none.")
    seed: int = Field(0, description="Seed passed to the server and used for prompt shuffling.")
    part_size: int = Field(256, ge=1, description="Samples per durable part object (the unit of resume).")
    return_token_ids: bool | None = Field(None, description="Ask the server for the prompt's and the response's "
                                          "token ids (vLLM's return_token_ids), so samples hold exactly the tokens "
                                          "the target generated; default: on when serve.engine is vllm.")
