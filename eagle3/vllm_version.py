"""The vLLM versions eagle3ctl supports, and the installed one, read without importing vLLM.

Every stage that starts vLLM (serve, extract, evaluate) calls :func:`require_vllm` before
anything else, so a vLLM outside the range is one line that names the range, not a
failure deep inside vLLM. The range is declared here once; pyproject's ``vllm`` extra
spells the same bounds (a test keeps the two equal) and the serve image pins the newest.
Importing vLLM takes seconds and initialises CUDA; ``importlib.metadata`` takes neither.
"""

from __future__ import annotations

import re
from importlib import metadata

from eagle3.errors import StageError

Version = tuple[int, int, int]

OLDEST: Version = (0, 22, 1)
NEWEST_MINOR = (0, 34)  # every 0.34.x
SUPPORTED = "0.22.1 to 0.34.x"
REQUIREMENT = "vllm>=0.22.1,<0.35"  # pyproject's [vllm] extra says exactly this

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> Version:
    """(major, minor, patch) of a release string: ``0.26.0``, ``0.34.1rc1``, ``0.30.0+cu129``.

    Pre-releases and local builds count as their release (``0.35.0.dev3`` is 0.35.0)."""
    m = _VERSION.match(text)
    if m is None:
        raise ValueError(f"not a vLLM version: {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def is_supported(version: Version) -> bool:
    return OLDEST <= version and version[:2] <= NEWEST_MINOR


def installed_vllm() -> str | None:
    """The installed vLLM's version string (its distribution metadata), or None."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def require_vllm(what: str) -> Version:
    """The installed vLLM's version; StageError naming the supported range when it is missing
    or outside it. ``what`` names the setting that asked for vLLM (``extract.engine=vllm``)."""
    text = installed_vllm()
    if text is None:
        raise StageError(f"{what} needs vLLM {SUPPORTED}, and none is installed here")
    try:
        version = parse_version(text)
    except ValueError:
        raise StageError(f"{what} needs vLLM {SUPPORTED}; the installed one says its version is {text!r}") from None
    if not is_supported(version):
        raise StageError(f"{what} needs vLLM {SUPPORTED}; installed: {text}")
    return version
