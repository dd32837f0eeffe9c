"""Settings of the evaluate stage: acceptance length on held-out prompts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class VllmEvaluateSettings(BaseModel):
    """vLLM's engine of evaluate.engine=vllm (target + drafter); defaults as ``vllm serve``'s."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int | None = Field(None, ge=1, description="Default: every visible GPU.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enforce_eager: bool = Field(False, description="No CUDA graphs / torch.compile: a faster start, slower "
                                "decoding.")
    max_model_len: int | None = Field(None, ge=1, description="Default: the target's context length (KV cache "
                                      "for one such sequence must fit).")


class EvaluateSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: str | None = Field(None, description="Held-out prompts (same formats as generate); default the "
                                "prompts that generate did not use, else the last samples of generate's prompts.")
    num_prompts: int = Field(64, ge=1)
    num_draft_tokens: int = Field(5, ge=1, description="k: draft tokens proposed per verification step.")
    max_new_tokens: int = Field(256, ge=1)
    engine: str = Field("hf", pattern="^(hf|vllm)$", description="hf: offline speculative decoding with transformers; "
                        "vllm: serve target + drafter with speculative_config and read vLLM's metrics.")
    vllm: VllmEvaluateSettings = Field(default_factory=lambda: VllmEvaluateSettings())
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
