"""Tiny targets for the extract tests (built once per session by tests/fixtures_targets.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_target_dirs(tiny_target_dir) -> dict[str, Path]:
    return {arch: tiny_target_dir(arch) for arch in ("llama", "deepseek")}
