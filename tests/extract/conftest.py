"""Tiny targets for the extract tests (built once per session by tests/fixtures_targets.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_target_dirs(tiny_target_dir) -> dict[str, Path]:
    return {arch: tiny_target_dir(arch) for arch in ("llama", "deepseek")}


@pytest.fixture(params=["llama", "deepseek"])
def tiny_target(request: pytest.FixtureRequest, tiny_target_dirs: dict[str, Path]):
    """(arch, loaded fp32 model) for each tiny architecture."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dirs[request.param], dtype=torch.float32).eval()
    return request.param, model
