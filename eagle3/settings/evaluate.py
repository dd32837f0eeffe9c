"""Settings of the evaluate stage: acceptance length on held-out prompts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EvaluateSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: str | None = Field(None, description="Held-out prompts (same formats as generate); default the "
                                "prompts that generate did not use, else the last samples of generate's prompts.")
    num_prompts: int = Field(64, ge=1)
    num_draft_tokens: int = Field(5, ge=1, description="k: draft tokens proposed per verification step.")
    max_new_tokens: int = Field(256, ge=1)
    engine: str = Field("hf", pattern="^(hf|vllm)$", description="hf: offline speculative decoding with transformers; "
                        "vllm: serve target + drafter with speculative_config and read vLLM's metrics.")
    device: str = Field("auto")
    check_greedy: int = Field(8, ge=0, description="hf engine: prompts whose speculative output is also compared "
                              "with the target's plain greedy output (verification correctness).")
    workers: int = Field(1, ge=1, description="hf engine: processes decoding prompts in parallel on the evaluate "
                         "device, each with its own target + drafter (memory: workers x (target + drafter)); for "
                         "small targets on a big GPU, where one process leaves the device mostly idle. The vllm "
                         "engine ignores it.")
    batch_size: int = Field(1, ge=1, description="hf engine: prompts each process decodes together in lockstep (one "
                            "target forward and k drafter steps per round for the whole batch; same report as 1). "
                            "Combines with workers: each worker decodes its share in batches of this size.")
