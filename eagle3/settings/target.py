"""Settings of the target model: the served model the drafter learns to predict."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class TargetSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        "builtin:tiny-llama",
        description="HF model directory or id, or builtin:tiny-llama / builtin:tiny-deepseek "
        "(a tiny random target built from config, for demos and tests).",
    )
    tokenizer: str | None = Field(None, description="Tokenizer path or id; defaults to the model's.")
    served_name: str | None = Field(None, description="Model name the endpoint serves; defaults to `model`.")
    vocab_size: int | None = Field(
        None, gt=0, description="Expected target vocab size; the tokenizer and model must agree with it."
    )
    aux_layer_ids: list[int] | None = Field(
        None,
        description="Aux hidden-state layer ids in vLLM's convention (id k = input to decoder layer k = "
        "HF hidden_states[k]). Default (2, L//2, L-3); Kimi-K2.5 (L=61): [2, 30, 58].",
    )
    trust_remote_code: bool = Field(False, description="Allow the model's own code (Kimi-K2.5 needs it).")
    dtype: str = Field("auto", description="The dtype the target runs in, in every engine (serve, extract, evaluate; "
                       "vLLM and transformers): bfloat16, float16, float32, or auto: vLLM's own rule on a GPU (the "
                       "config's dtype, float32 downcast to bfloat16), the config's dtype on CPU. The drafter learns "
                       "the hidden states of this dtype: serve the target in it.")
    cache_dir: str = Field(".eagle3/targets", description="Where builtin targets are built and HF files cached.")

    @field_validator("aux_layer_ids")
    @classmethod
    def _ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if len(v) != 3:
                raise ValueError("EAGLE-3 uses exactly 3 aux layers")
            if any(i < 0 for i in v) or sorted(set(v)) != v:
                raise ValueError("aux layer ids must be distinct, non-negative and increasing")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError("must be auto, bfloat16, float16 or float32")
        return v
