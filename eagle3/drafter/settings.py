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
    rope_theta: float = Field(10000.0, gt=0)
    max_position_embeddings: int = Field(8192, ge=1)
