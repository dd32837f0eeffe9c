"""benchmarks/quality's scripts as modules for the tests (they are scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

QUALITY = Path(__file__).resolve().parents[2] / "benchmarks" / "quality"


def load(name: str) -> ModuleType:
    """benchmarks/quality/<name>.py, imported as ``quality_<name>``; the folder goes on sys.path, where a
    script run from it finds its siblings (``from files import write_json``)."""
    if str(QUALITY) not in sys.path:
        sys.path.append(str(QUALITY))
    spec = importlib.util.spec_from_file_location(f"quality_{name}", QUALITY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
