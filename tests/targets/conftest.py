"""A loaded tiny target for the capture tests (built once per session by tests/fixtures_targets.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["llama", "deepseek"])
def tiny_target(request: pytest.FixtureRequest, tiny_target_dir):
    """(arch, loaded fp32 model) for each tiny architecture."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir(request.param), dtype=torch.float32).eval()
    return request.param, model
