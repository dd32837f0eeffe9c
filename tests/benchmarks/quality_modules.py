"""benchmarks/quality's scripts as modules for the tests (they are scripts, not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

QUALITY = Path(__file__).resolve().parents[2] / "benchmarks" / "quality"


def load(name: str) -> ModuleType:
    """benchmarks/quality/<name>.py, imported as ``quality_<name>``."""
    spec = importlib.util.spec_from_file_location(f"quality_{name}", QUALITY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
