"""Shape of the EAGLE-3 drafter; anything left unset follows the target."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DrafterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hidden_size: int | None = Field(None, ge=1, description="Drafter width; default the target's hidden size.")
    intermediate_size: int | None = Field(None, ge=1, description="SwiGLU width; default the target's (dense) or 4·h.")
    num_attention_heads: int | None = Field(None, ge=1, description="Default the target's.")
    num_key_value_heads: int | None = Field(None, ge=1, description="Default the target's, else heads.")
    head_dim: int | None = Field(None, ge=1, description="Default hidden_size // heads.")
    rms_norm_eps: float = Field(1e-6, gt=0)
    rope_theta: float | None = Field(None, gt=0, description="RoPE base; default the target's (rope_theta, or "
                                     "rope_parameters.rope_theta). The drafter's RoPE is unscaled: a target's "
                                     "scaling (Kimi-K2.5's YaRN) is not copied.")
    max_position_embeddings: int | None = Field(None, ge=1, description="Positions the drafter serves; default the "
                                                "target's. vLLM drafts only while a sequence fits min(drafter, "
                                                "target): less than the target stops drafting on long traces.")
