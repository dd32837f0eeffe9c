"""Fixtures of the container tests: a usable Docker engine and the CPU stage image."""

from __future__ import annotations

import os

import pytest

from tests.containers.docker import build_cpu_image, docker_problem


@pytest.fixture(scope="session")
def docker_engine() -> None:
    """Skip (or, with EAGLE3_REQUIRE_DOCKER=1 as in CI, fail) when no Docker engine answers."""
    problem = docker_problem()
    if problem is not None:
        if os.environ.get("EAGLE3_REQUIRE_DOCKER") == "1":
            pytest.fail(f"EAGLE3_REQUIRE_DOCKER=1 but {problem}")
        pytest.skip(problem)


@pytest.fixture(scope="session")
def cpu_image(docker_engine: None) -> str:
    """The CPU stage image, built from this checkout by scripts/build-images.sh (cached layers)."""
    ref, log = build_cpu_image()
    sizes = [line for line in log.splitlines() if " MB" in line and "build-images:" in line]
    print("\n".join(sizes))
    return ref
