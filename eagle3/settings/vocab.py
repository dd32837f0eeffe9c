"""Settings of the vocab stage."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class VocabSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    draft_vocab_size: int = Field(32000, ge=1, description="Tokens in the draft vocab (top-N by frequency over assistant tokens).")
