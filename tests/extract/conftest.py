"""Tiny targets for the extract / export / evaluate tests, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """target.cache_dir holding both builtin tiny targets (built once per session)."""
    from eagle3.targets.tiny import builtin_target_dir

    cache = tmp_path_factory.mktemp("targets")
    for arch in ("llama", "deepseek"):
        builtin_target_dir(arch, cache)
    return cache


@pytest.fixture(scope="session")
def tiny_target_dirs(tiny_cache_dir: Path) -> dict[str, Path]:
    from eagle3.targets.tiny import builtin_target_dir

    return {arch: builtin_target_dir(arch, tiny_cache_dir) for arch in ("llama", "deepseek")}


@pytest.fixture(params=["llama", "deepseek"])
def tiny_target(request: pytest.FixtureRequest, tiny_target_dirs: dict[str, Path]):
    """(arch, loaded fp32 model) for each tiny architecture."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dirs[request.param], dtype=torch.float32).eval()
    return request.param, model
