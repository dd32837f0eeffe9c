"""The image definitions stay in step with the package (fast; no Docker needed)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "images" / "requirements.txt"


def _lock() -> dict[str, Version]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"images/requirements.txt: {line!r} is not pinned with =="
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_lock_pins_every_runtime_dependency_of_the_package() -> None:
    """An offline image build installs only the lock: a dependency missing there breaks the image."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = _lock()
    for dep in map(Requirement, deps):
        name = canonicalize_name(dep.name)
        if name == "torch":  # pinned by TORCH_VERSION (cpu) or the base image (gpu)
            continue
        assert name in pins, f"{dep.name} is a dependency but not in images/requirements.txt (python images/lock.py)"
        assert dep.specifier.contains(pins[name], prereleases=True), f"lock pins {name}=={pins[name]}, package wants {dep}"
    assert "torch" not in pins
    assert {"setuptools", "wheel"} <= set(pins)  # the builder stage builds the wheel offline


def test_base_images_are_pinned_tags() -> None:
    for path, arg in ((REPO / "Dockerfile", "BASE_IMAGE"), (REPO / "images" / "serve.Dockerfile", "VLLM_IMAGE")):
        m = re.search(rf"^ARG {arg}=(\S+)$", path.read_text(), re.M)
        assert m, f"{path.name}: no default for {arg}"
        image, _, tag = m.group(1).rpartition(":")
        assert image and tag and tag != "latest" and re.search(r"\d", tag), f"{path.name}: {arg} must be a pinned tag"


def test_dockerfile_runs_as_non_root_with_the_stage_entrypoint() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert "USER 10001:10001" in text
    assert 'ENTRYPOINT ["eagle3"]' in text
    assert re.search(r"^ARG VARIANT=gpu$", text, re.M)


def test_serve_constraints_keep_what_the_base_already_has(tmp_path: Path) -> None:
    lock = tmp_path / "requirements.txt"
    lock.write_text("# comment\npytest==0.0.1\nno-such-distribution-eagle3==1.2.3\n")
    r = subprocess.run([sys.executable, str(REPO / "images" / "serve_constraints.py"), str(lock)],
                       capture_output=True, text=True, check=True)
    assert r.stdout.splitlines() == ["no-such-distribution-eagle3==1.2.3"]
