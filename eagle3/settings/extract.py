"""Settings of the extract stage: hidden states of the target on the tokenized samples."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from eagle3.processes import ProcsPerNode


class VllmExtractSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int | None = Field(None, ge=1, description="Default: every visible GPU.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    hidden_states_dir: str = Field("/dev/shm/eagle3-hidden-states", description="Where vLLM's connector writes each "
                                   "request's file before it is read into a shard and deleted (RAM-backed: "
                                   "bounded by one shard's samples).")
    enforce_eager: bool = Field(True, description="No CUDA graphs / torch.compile (the final-hidden plugin's hook "
                                "wraps the model's forward where it is used: DeepseekV2-family targets on vLLM "
                                "0.22.1-0.24.x).")


class ExtractSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_tokens: int = Field(16384, ge=1, description="Tokens per forward batch (length-bucketed, padding excluded).")
    shard_tokens: int = Field(1 << 20, ge=1, description="Tokens per hidden-state shard streamed to the store "
                              "(a process holds two in host memory: one being extracted, one being stored).")
    storage_dtype: str = Field("bfloat16", pattern="^(bfloat16|float8_e4m3fn|float32)$",
                               description="bfloat16, or float8_e4m3fn with a per-row scale (half the bytes).")
    device: str = Field("auto", description="auto, cpu, cuda, or cuda:N.")
    engine: str = Field("hf", pattern="^(hf|vllm)$", description="hf: transformers forward passes with hooks "
                        "(targets that fit the node in the load dtype); vllm: the target in vLLM with the "
                        "extract_hidden_states method and a hidden-states connector (Kimi-K2.5: INT4 as shipped), "
                        "run in the serve image.")
    vllm: VllmExtractSettings = Field(default_factory=lambda: VllmExtractSettings())
    nproc_per_node: ProcsPerNode = Field("auto", description="Processes per node (torchrun; auto = GPUs, or 1 on CPU): the "
                                      "shards are dealt to them, each on its own GPU; a target too large for one GPU "
                                      "is spread over the node's GPUs by local rank 0 alone.")
