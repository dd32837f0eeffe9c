"""Settings of the extract stage: hidden states of the target on the tokenized samples."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from eagle3.processes import ProcsPerNode


class ExtractSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_tokens: int = Field(16384, ge=1, description="Tokens per forward batch (length-bucketed, padding excluded).")
    shard_tokens: int = Field(1 << 20, ge=1, description="Tokens per hidden-state shard streamed to the store "
                              "(a process holds two in host memory: one being extracted, one being stored).")
    storage_dtype: str = Field("bfloat16", pattern="^(bfloat16|float8_e4m3fn|float32)$",
                               description="bfloat16, or float8_e4m3fn with a per-row scale (half the bytes).")
    device: str = Field("auto", description="auto, cpu, cuda, or cuda:N.")
    nproc_per_node: ProcsPerNode = Field("auto", description="Processes per node (torchrun; auto = GPUs, or 1 on CPU): the "
                                      "shards are dealt to them, each on its own GPU; a target too large for one GPU "
                                      "is spread over the node's GPUs by local rank 0 alone.")
