"""Settings of the export stage: the drafter directory vLLM and SGLang load."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ExportSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sglang: bool = Field(True, description="Export for SGLang too: eagle_config carries the aux ids converted by "
                         "SGLang's rule for the target's family (Llama-style: ids - 1; DeepseekV2/V3 and Kimi-K2.5: "
                         "as given). Ids SGLang cannot express for the family (a DeepseekV2-family target's ids "
                         "starting at 1) or a family whose rule is not known are refused at export; false exports "
                         "for vLLM only.")
