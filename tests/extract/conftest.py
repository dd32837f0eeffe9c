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


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models on a shared 2-core machine: extra threads only spin (40x slower under load)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
